//! Durations: [`parse_duration`] and [`format_duration`], both `humantime`'s grammar.
//!
//! humantime accepts exactly the spellings asked of us (`200us`, `200µs`, `2ms`, `1.5ms`,
//! `10s`, and sums such as `1s 500ms`) and refuses a bare number ("time unit needed"), so it
//! is used as it is; this module only puts the text that was given into the error.

use std::time::Duration;

use crate::UnitError;

/// Parse a duration (see the crate docs): a number, with an optional decimal fraction, and
/// a unit (`ns`, `us`/`µs`, `ms`, `s`, `min`, `h`, ... as humantime spells them), or a sum
/// of them (`1s 500ms`). A unit is required.
pub fn parse_duration(s: &str) -> Result<Duration, UnitError> {
    humantime::parse_duration(s.trim()).map_err(|source| UnitError::NotADuration {
        input: s.into(),
        source,
    })
}

/// The exact form [`parse_duration`] reads back: `200us`, `2ms`, `1s 500ms`.
pub fn format_duration(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_the_usual_spellings() {
        assert_eq!(parse_duration("200us"), Ok(Duration::from_micros(200)));
        assert_eq!(parse_duration("200µs"), Ok(Duration::from_micros(200)));
        assert_eq!(parse_duration("2ms"), Ok(Duration::from_millis(2)));
        assert_eq!(parse_duration(" 1.5ms "), Ok(Duration::from_micros(1500)));
        assert_eq!(parse_duration("20ns"), Ok(Duration::from_nanos(20)));
        assert_eq!(parse_duration("1s 500ms"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("20 us"), Ok(Duration::from_micros(20)));
    }

    #[test]
    fn refuses_bare_numbers_and_nonsense() {
        for bad in ["5", "", "fast", "-5ms", "5 parsecs", "1.5ns"] {
            let e = parse_duration(bad).unwrap_err();
            assert!(
                matches!(&e, UnitError::NotADuration { input, .. } if input == bad),
                "{bad}: {e}"
            );
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
        assert!(parse_duration("5")
            .unwrap_err()
            .to_string()
            .contains("unit"));
    }

    #[test]
    fn formats_what_it_parses() {
        assert_eq!(format_duration(Duration::from_micros(200)), "200us");
        assert_eq!(format_duration(Duration::from_millis(2)), "2ms");
    }

    proptest! {
        #[test]
        fn format_parse_round_trip(ns in 0u64..86_400_000_000_000) {
            let d = Duration::from_nanos(ns);
            prop_assert_eq!(parse_duration(&format_duration(d)), Ok(d));
        }
    }
}
