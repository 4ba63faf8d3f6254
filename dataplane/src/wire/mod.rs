//! Wire formats (filled in by the wire work).
