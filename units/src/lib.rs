//! Sizes, rates and durations as users write them: the one grammar every gradwire command
//! line (`gradwire`, `gradwire-ctl`), policy file and topology file accepts, with one error
//! message per mistake wherever it is made.
//!
//! # Grammar
//!
//! All three are `<number>[spaces]<unit>`, surrounded by optional spaces. Units are
//! case-insensitive (`25gbit` = `25Gbit`, `64kib` = `64KiB`), except that humantime's
//! duration units are lower case.
//!
//! | kind | number | units | bare number |
//! |------|--------|-------|-------------|
//! | size ([`parse_size`] -> [`Bytes`]) | whole, >= 0 | `B`; `K`/`KB`, `M`/`MB`, `G`/`GB` = 10^3, 10^6, 10^9; `KiB`, `MiB`, `GiB` = 2^10, 2^20, 2^30 | bytes (`1500`) |
//! | rate ([`parse_rate`] -> [`BitRate`], bit/s) | decimal fraction allowed, rounded to the nearest bit/s, > 0 | `bit`; `K`/`Kbit`, `M`/`Mbit`, `G`/`Gbit` = 10^3, 10^6, 10^9; `Kibit`, `Mibit`, `Gibit` = 2^10, 2^20, 2^30; optional `/s` after `bit` | refused |
//! | duration ([`parse_duration`] -> `Duration`) | decimal fraction allowed (not below 1 ns) | humantime's: `ns`, `us`/`µs`, `ms`, `s`, `min`, `h`, ...; sums like `1s 500ms` | refused |
//!
//! The same letter means bytes in a size and bits in a rate: `25G` is 25 * 10^9 bytes as a
//! size and 25 Gbit/s as a rate, the way switch and NIC speeds are written (a 25G port).
//! K, M, G are always decimal; a binary multiple is spelled with `i` (`64KiB`, as `64K` is
//! 64000 bytes). Rates use `tc`'s spellings (`200Mbit`, `25gbit`, `10kibit`), but refuse what
//! tc reads differently from people: a bare number (tc: bit/s; usually a forgotten `G`) and
//! any `...bps` (tc: BYTES per second; datasheets: bits). Terabit units are not accepted
//! (write `1000G`); no gradwire link runs that fast.
//!
//! Every parser's error is a [`UnitError`] whose message names the text given and lists the
//! accepted forms. Each `Display` here ([`Bytes`], [`BitRate`], [`format_duration`]) prints
//! an exact form the matching parser reads back; [`human_size`] rounds for tables.
//!
//! # Why hand-written (sizes and rates)
//!
//! Durations are humantime's grammar unchanged. For sizes, `bytesize` accepts fractions
//! (`1.5KiB`), which a byte count refuses here, and `byte-unit` reads a lower-case `b` as
//! bits, against the case-insensitive `64kb` = 64000 bytes that policy files already use.
//! No crate parses `tc`'s rate spellings. Both parsers are a few lines over `str`.
//!
//! # In files
//!
//! Sizes in policy files are a [`SizeValue`] (a number of bytes or a string), rates and
//! durations in topology files a [`WrittenValue`] (string or number, kept as written): both
//! deserialise anything and leave parsing to the same functions, so the file reader can name
//! the field in the error. [`BitRate`] also deserialises directly through [`parse_rate`].
#![forbid(unsafe_code)]

mod duration;
mod rate;
mod size;

use std::fmt;

use serde::{Deserialize, Serialize};

pub use duration::{format_duration, parse_duration};
pub use rate::{parse_rate, BitRate};
pub use size::{human_size, parse_size, Bytes, Cells, Kilobytes, SizeValue, BYTES_PER_KB};

/// Why a size, rate or duration was refused. The messages name the text that was given.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum UnitError {
    /// The text does not start with a number.
    #[error("{input:?} is not a size (examples: 1500, 1500B, 64KiB, 64KB, 2MiB)")]
    NotASize {
        /// What was given.
        input: String,
    },
    /// The unit suffix of a size is unknown.
    #[error("{input:?}: unknown size unit {unit:?} (use B, K or KB, KiB, M or MB, MiB, G or GB, GiB; K = 1000, Ki = 1024; whole numbers only)")]
    UnknownUnit {
        /// What was given.
        input: String,
        /// The suffix.
        unit: String,
    },
    /// The value does not fit 64 bits.
    #[error("{input:?} is too large")]
    Overflow {
        /// What was given.
        input: String,
    },
    /// A number in a file that is not a size: negative, fractional, or not a number at all.
    #[error("{input} is not a size: give a whole number of bytes >= 0 (e.g. 65536) or a string with a unit (e.g. \"64KiB\", \"64KB\"; K = 1000, Ki = 1024)")]
    NotWholeBytes {
        /// What was given, as written.
        input: String,
    },
    /// The text does not start with a number.
    #[error("{input:?} is not a rate: give bits per second with a unit (e.g. 25G, 25Gbit, 200Mbit, 1.5Gbit)")]
    NotARate {
        /// What was given.
        input: String,
    },
    /// A rate without a unit.
    #[error(
        "{input:?}: a rate needs a unit (bit, K or Kbit, M or Mbit, G or Gbit; e.g. 25G, 200Mbit)"
    )]
    RateUnitRequired {
        /// What was given.
        input: String,
    },
    /// The unit suffix of a rate is unknown.
    #[error("{input:?}: unknown unit {unit:?} for a rate (bit, K or Kbit, M or Mbit, G or Gbit, Kibit, Mibit, Gibit; bits per second)")]
    UnknownRateUnit {
        /// What was given.
        input: String,
        /// The suffix.
        unit: String,
    },
    /// `bps`, `Gbps`, ...: bytes for tc, bits for datasheets.
    #[error("{input:?}: {unit:?} is ambiguous (tc reads bps as bytes per second, datasheets as bits): write bits per second, e.g. 25Gbit or 25G")]
    AmbiguousBps {
        /// What was given.
        input: String,
        /// The suffix.
        unit: String,
    },
    /// A rate of zero.
    #[error("{input:?}: a rate must be above 0 bit/s")]
    ZeroRate {
        /// What was given.
        input: String,
    },
    /// A duration humantime refuses.
    #[error("{input:?} is not a duration ({source}; e.g. 200us, 2ms, 1.5s)")]
    NotADuration {
        /// What was given.
        input: String,
        /// humantime's reason.
        source: humantime::DurationError,
    },
}

/// A rate or duration as written in a file, before parsing: a string, or a number kept as
/// its text (so `rate = 100` meets the same "needs a unit" error as `--line-rate 100`).
///
/// Deserialising accepts strings and numbers; anything else is refused with the accepted
/// forms. Parse with [`WrittenValue::rate`] or [`WrittenValue::duration`], then name the
/// field in the error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct WrittenValue(pub String);

impl WrittenValue {
    /// Through [`parse_rate`].
    pub fn rate(&self) -> Result<BitRate, UnitError> {
        parse_rate(&self.0)
    }

    /// Through [`parse_duration`].
    pub fn duration(&self) -> Result<std::time::Duration, UnitError> {
        parse_duration(&self.0)
    }
}

impl<'de> Deserialize<'de> for WrittenValue {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = WrittenValue;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string with a number and a unit (e.g. \"25G\", \"200Mbit\", \"20us\", \"2ms\")")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<WrittenValue, E> {
                Ok(WrittenValue(v.to_string()))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<WrittenValue, E> {
                Ok(WrittenValue(v.to_string()))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<WrittenValue, E> {
                Ok(WrittenValue(v.to_string()))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<WrittenValue, E> {
                Ok(WrittenValue(v.to_string()))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_spellings_of_the_issue() {
        assert_eq!(parse_rate("25G"), Ok(BitRate(25_000_000_000)));
        assert_eq!(parse_rate("25Gbit"), Ok(BitRate(25_000_000_000)));
        assert_eq!(parse_rate("200Mbit"), Ok(BitRate(200_000_000)));
        assert_eq!(parse_rate("200M"), Ok(BitRate(200_000_000)));
        assert_eq!(parse_size("64KiB"), Ok(Bytes(65536)));
        assert_eq!(parse_size("1500"), Ok(Bytes(1500)));
        assert_eq!(parse_size("25G"), Ok(Bytes(25_000_000_000)));
        assert_eq!(
            parse_duration("200us"),
            Ok(std::time::Duration::from_micros(200))
        );
        assert_eq!(
            parse_duration("2ms"),
            Ok(std::time::Duration::from_millis(2))
        );
    }

    #[test]
    fn written_values_keep_numbers_as_text() {
        let v: WrittenValue =
            toml::from_str::<std::collections::BTreeMap<String, WrittenValue>>("rate = 100")
                .unwrap()
                .remove("rate")
                .unwrap();
        assert_eq!(v, WrittenValue("100".into()));
        assert_eq!(v.rate(), parse_rate("100"));
        let v: WrittenValue = serde_json::from_str("\"20us\"").unwrap();
        assert_eq!(v.duration(), Ok(std::time::Duration::from_micros(20)));
        let e = serde_json::from_str::<WrittenValue>("[1]")
            .unwrap_err()
            .to_string();
        assert!(e.contains("a number and a unit"), "{e}");
    }

    /// Sizes and rates share the number syntax but not the units: a string that is one is
    /// never silently read as the other with a different meaning.
    #[test]
    fn byte_units_are_not_rates_and_bit_units_are_not_sizes() {
        for s in ["64KiB", "64KB", "1500B", "2MiB"] {
            assert!(parse_rate(s).is_err(), "{s}");
        }
        for s in ["200Mbit", "25Gbit", "10kibit"] {
            assert!(parse_size(s).is_err(), "{s}");
        }
    }

    proptest! {
        /// Whatever the text, a parser either refuses it or returns what its `Display`
        /// prints back, and never panics.
        #[test]
        fn any_text_parses_consistently(s in "[ 0-9.a-zA-Zµ/-]{0,16}") {
            if let Ok(b) = parse_size(&s) {
                prop_assert_eq!(parse_size(&b.to_string()), Ok(b));
            }
            if let Ok(r) = parse_rate(&s) {
                prop_assert_eq!(parse_rate(&r.to_string()), Ok(r));
            }
            if let Ok(d) = parse_duration(&s) {
                prop_assert_eq!(parse_duration(&format_duration(d)), Ok(d));
            }
        }
    }
}
