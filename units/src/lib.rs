//! Sizes, rates and durations as users write them (work in progress: being moved here from
//! `gradwire_control::units`).
#![forbid(unsafe_code)]
