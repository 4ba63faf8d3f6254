//! Rates in bits per second: [`BitRate`] and its grammar ([`parse_rate`]).
//!
//! The spellings are `tc`'s (iproute2 `get_rate`): `bit`, `kbit`, `mbit`, `gbit` decimal,
//! `kibit`, `mibit`, `gibit` binary, case-insensitive; plus the bare prefixes `K`, `M`, `G`
//! meaning bits, as switch and NIC speeds are written (`25G`, `100G`). Two of `tc`'s forms
//! are refused on purpose: a bare number (tc reads bit/s, but `--line-rate 25` is far more
//! likely a forgotten `G` than 25 bit/s) and the `bps` family (tc reads `Gbps` as gigaBYTES
//! per second, most datasheets as gigabits: whichever we chose, someone would be off by 8).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::UnitError;

/// A rate in bits per second, never zero when it comes from [`parse_rate`].
///
/// Serialised as its exact text (`"25Gbit"`); deserialised through [`parse_rate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BitRate(pub u64);

impl BitRate {
    /// Bits per second.
    pub const fn bps(self) -> u64 {
        self.0
    }
}

impl fmt::Display for BitRate {
    /// The shortest exact form: `25Gbit`, `1500Mbit`, `1234bit`. [`parse_rate`] reads it
    /// back (`0bit` is printed for zero, which the grammar refuses).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u64); 3] = [
            ("Gbit", 1_000_000_000),
            ("Mbit", 1_000_000),
            ("Kbit", 1_000),
        ];
        for (name, m) in UNITS {
            if self.0 != 0 && self.0 % m == 0 {
                return write!(f, "{}{name}", self.0 / m);
            }
        }
        write!(f, "{}bit", self.0)
    }
}

impl FromStr for BitRate {
    type Err = UnitError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_rate(s)
    }
}

impl Serialize for BitRate {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for BitRate {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let written = crate::WrittenValue::deserialize(d)?;
        written.rate().map_err(serde::de::Error::custom)
    }
}

/// Digits after the decimal point that are looked at; the rest cannot change the result by
/// a whole bit per second (the largest multiplier is 2^30 < 10^10).
const MAX_FRACTION_DIGITS: usize = 18;

/// Parse a rate (see the crate docs for the grammar): a number, with an optional decimal
/// fraction, then a unit: `25G`, `25Gbit`, `25gbit/s`, `200Mbit`, `1.5 Gbit`, `10Kibit`.
/// The result is rounded to the nearest bit per second and must not be zero.
pub fn parse_rate(s: &str) -> Result<BitRate, UnitError> {
    let t = s.trim();
    let int_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (int, rest) = t.split_at(int_end);
    let (point, frac, rest) = match rest.strip_prefix('.') {
        Some(r) => {
            let end = r.find(|c: char| !c.is_ascii_digit()).unwrap_or(r.len());
            let (frac, rest) = r.split_at(end);
            (true, frac, rest)
        }
        None => (false, "", rest),
    };
    if int.is_empty() || (point && frac.is_empty()) {
        // No number, or a '.' without digits after it.
        return Err(UnitError::NotARate { input: s.into() });
    }
    let unit = rest.trim().to_ascii_lowercase();
    let mult: u64 = match unit.strip_suffix("/s").unwrap_or(&unit) {
        "" => return Err(UnitError::RateUnitRequired { input: s.into() }),
        "bit" => 1,
        "k" | "kbit" => 1_000,
        "m" | "mbit" => 1_000_000,
        "g" | "gbit" => 1_000_000_000,
        "kibit" => 1 << 10,
        "mibit" => 1 << 20,
        "gibit" => 1 << 30,
        u if u.ends_with("bps") => {
            return Err(UnitError::AmbiguousBps {
                input: s.into(),
                unit: rest.trim().into(),
            })
        }
        _ => {
            return Err(UnitError::UnknownRateUnit {
                input: s.into(),
                unit: rest.trim().into(),
            })
        }
    };
    let overflow = || UnitError::Overflow { input: s.into() };
    let whole: u128 = u128::from(int.parse::<u64>().map_err(|_| overflow())?) * u128::from(mult);
    let frac = &frac[..frac.len().min(MAX_FRACTION_DIGITS)];
    let part: u128 = if frac.is_empty() {
        0
    } else {
        // Exact decimal arithmetic (no f64), rounded half up: parse(display(x)) == x for
        // every u64.
        let digits: u128 = frac.parse::<u64>().map_err(|_| overflow())?.into();
        let scale = 10u128.pow(frac.len() as u32);
        (digits * u128::from(mult) + scale / 2) / scale
    };
    let bps = u64::try_from(whole + part).map_err(|_| overflow())?;
    if bps == 0 {
        return Err(UnitError::ZeroRate { input: s.into() });
    }
    Ok(BitRate(bps))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_tc_and_datasheet_spellings() {
        assert_eq!(parse_rate("25G"), Ok(BitRate(25_000_000_000)));
        assert_eq!(parse_rate("25Gbit"), Ok(BitRate(25_000_000_000)));
        assert_eq!(parse_rate("25gbit"), Ok(BitRate(25_000_000_000)));
        assert_eq!(parse_rate("25 Gbit/s"), Ok(BitRate(25_000_000_000)));
        assert_eq!(parse_rate("200Mbit"), Ok(BitRate(200_000_000)));
        assert_eq!(parse_rate("200M"), Ok(BitRate(200_000_000)));
        assert_eq!(parse_rate("1.5 Gbit"), Ok(BitRate(1_500_000_000)));
        assert_eq!(parse_rate("0.5bit"), Ok(BitRate(1)));
        assert_eq!(parse_rate("10kibit"), Ok(BitRate(10_240)));
        assert_eq!(parse_rate("1Gibit"), Ok(BitRate(1 << 30)));
        assert_eq!(parse_rate("64bit"), Ok(BitRate(64)));
    }

    #[test]
    fn refuses_what_would_be_misread() {
        let e = |s: &str| parse_rate(s).unwrap_err();
        assert!(matches!(e("100"), UnitError::RateUnitRequired { .. }));
        assert!(e("100").to_string().contains("unit"));
        assert!(matches!(e("25Gbps"), UnitError::AmbiguousBps { .. }));
        assert!(matches!(e("25GBps"), UnitError::AmbiguousBps { .. }));
        assert!(matches!(e("64KiB"), UnitError::UnknownRateUnit { .. }));
        assert!(matches!(e("1Tbit"), UnitError::UnknownRateUnit { .. }));
        assert!(matches!(e("25Gb"), UnitError::UnknownRateUnit { .. }));
        assert!(matches!(e("0bit"), UnitError::ZeroRate { .. }));
        assert!(matches!(e("0.1bit"), UnitError::ZeroRate { .. }));
        assert!(matches!(e("fast"), UnitError::NotARate { .. }));
        assert!(matches!(e(""), UnitError::NotARate { .. }));
        assert!(matches!(e("-5G"), UnitError::NotARate { .. }));
        assert!(matches!(e("5.G"), UnitError::NotARate { .. }));
        assert!(matches!(e(".5G"), UnitError::NotARate { .. }));
        assert!(matches!(
            e("99999999999999999999G"),
            UnitError::Overflow { .. }
        ));
        assert!(matches!(e("18446744074G"), UnitError::Overflow { .. }));
    }

    #[test]
    fn formats_shortest_exact() {
        assert_eq!(BitRate(25_000_000_000).to_string(), "25Gbit");
        assert_eq!(BitRate(1_500_000_000).to_string(), "1500Mbit");
        assert_eq!(BitRate(1234).to_string(), "1234bit");
    }

    #[test]
    fn serde_goes_through_the_grammar() {
        let r: BitRate = serde_json::from_str("\"200Mbit\"").unwrap();
        assert_eq!(r, BitRate(200_000_000));
        assert_eq!(serde_json::to_string(&r).unwrap(), "\"200Mbit\"");
        let e = serde_json::from_str::<BitRate>("200")
            .unwrap_err()
            .to_string();
        assert_eq!(e, parse_rate("200").unwrap_err().to_string());
    }

    proptest! {
        #[test]
        fn format_parse_round_trip(n in 1u64..) {
            let r = BitRate(n);
            prop_assert_eq!(parse_rate(&r.to_string()), Ok(r));
        }

        #[test]
        fn fractions_round_to_the_nearest_bit(whole in 0u64..1_000_000, milli in 0u64..1000) {
            let text = format!("{whole}.{milli:03}Kbit");
            let want = whole * 1000 + milli;
            if want == 0 {
                prop_assert!(parse_rate(&text).is_err());
            } else {
                prop_assert_eq!(parse_rate(&text), Ok(BitRate(want)));
            }
        }
    }
}
