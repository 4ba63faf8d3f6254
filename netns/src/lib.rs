//! gradwire's namespace kit (work in progress: being moved here from `gradwire::testbed`).
#![forbid(unsafe_code)]
