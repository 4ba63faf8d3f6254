//! Sizes with their unit in the type: [`Bytes`], [`Kilobytes`] (Onyx's unit) and [`Cells`]
//! (a switch ASIC's buffer unit; the ASICs and their cell sizes are `gradwire_control::Asic`),
//! the size grammar ([`parse_size`]), sizes in files ([`SizeValue`]) and the approximate form
//! for tables ([`human_size`]).
//!
//! Conversions that can lose precision round **up**, so a configured threshold is never
//! below the one asked for, and say so in their names (`*_ceil`). Conversions the other way
//! (cells or KB to bytes) are exact. Nothing here panics: arithmetic that could overflow is
//! checked and reported.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::UnitError;

/// A size in bytes (serialised as a plain number of bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize)]
#[serde(transparent)]
pub struct Bytes(pub u64);

/// A size in Onyx's "KB": 1 KB = 1024 bytes (see `docs/switch-control.md` for why 1024).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Kilobytes(pub u64);

/// A number of ASIC buffer cells; only meaningful together with the cell size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Cells(pub u64);

/// Bytes per Onyx KB.
pub const BYTES_PER_KB: u64 = 1024;

fn div_ceil(a: u64, b: u64) -> u64 {
    // b is never zero at the call sites (cell sizes and 1024 are constants > 0).
    if b == 0 {
        return 0;
    }
    a / b + u64::from(a % b != 0)
}

impl Bytes {
    /// The number of whole cells of `cell` bytes needed to hold this many bytes (rounded up).
    pub fn to_cells_ceil(self, cell: Bytes) -> Cells {
        Cells(div_ceil(self.0, cell.0))
    }

    /// This size rounded up to a whole number of cells, in bytes. `None` on overflow.
    pub fn round_up_to_cells(self, cell: Bytes) -> Option<Bytes> {
        self.to_cells_ceil(cell).to_bytes(cell)
    }

    /// In Onyx KB, rounded up.
    pub fn to_kilobytes_ceil(self) -> Kilobytes {
        Kilobytes(div_ceil(self.0, BYTES_PER_KB))
    }
}

impl Cells {
    /// Exact size in bytes. `None` on overflow.
    pub fn to_bytes(self, cell: Bytes) -> Option<Bytes> {
        self.0.checked_mul(cell.0).map(Bytes)
    }
}

impl Kilobytes {
    /// Exact size in bytes. `None` on overflow.
    pub fn to_bytes(self) -> Option<Bytes> {
        self.0.checked_mul(BYTES_PER_KB).map(Bytes)
    }
}

impl fmt::Display for Bytes {
    /// The shortest exact form: `64KiB`, `3MiB`, `1500B`. [`parse_size`] reads it back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
        for (name, m) in UNITS {
            if self.0 != 0 && self.0 % m == 0 {
                return write!(f, "{}{name}", self.0 / m);
            }
        }
        write!(f, "{}B", self.0)
    }
}

impl FromStr for Bytes {
    type Err = UnitError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_size(s)
    }
}

/// Parse a size (see the crate docs for the grammar): a whole number with an optional unit.
/// `B` or none = bytes; `K`/`KB`, `M`/`MB`, `G`/`GB` are decimal (1000); `KiB`, `MiB`, `GiB`
/// are binary (1024). Case-insensitive, spaces around the unit allowed.
pub fn parse_size(s: &str) -> Result<Bytes, UnitError> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(UnitError::NotASize { input: s.into() });
    }
    let n: u64 = num
        .parse()
        .map_err(|_| UnitError::Overflow { input: s.into() })?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "kib" => 1 << 10,
        "m" | "mb" => 1_000_000,
        "mib" => 1 << 20,
        "g" | "gb" => 1_000_000_000,
        "gib" => 1 << 30,
        other => {
            return Err(UnitError::UnknownUnit {
                input: s.into(),
                unit: other.into(),
            })
        }
    };
    n.checked_mul(mult)
        .map(Bytes)
        .ok_or_else(|| UnitError::Overflow { input: s.into() })
}

/// A size rounded for people: `1000B`, `1.5KiB`, `64.0MiB` (binary prefixes, one decimal,
/// no space, so it is one cell of a whitespace-separated table). The one size formatter of
/// the workspace (transfer reports, fabric tables). Not meant to be parsed back: [`Bytes`]'s
/// `Display` is the exact form [`parse_size`] reads.
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes}B")
    } else {
        format!("{v:.1}{}", UNITS[u])
    }
}

/// A size as written in a policy file: a number of bytes or a string with a unit.
///
/// Deserialising accepts any number or string, so that a wrong one (`base = -5`,
/// `base = 1.5`) reaches [`SizeValue::bytes`], whose error the policy-file reader reports
/// with the field's name and the accepted forms. Other types (arrays, tables, booleans) are
/// refused by the parser with the same list of accepted forms.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum SizeValue {
    /// Bytes.
    Bytes(u64),
    /// A string for [`parse_size`].
    Text(String),
    /// A number that is not a whole number of bytes (negative or fractional), as written.
    Invalid(String),
}

impl SizeValue {
    /// The size in bytes.
    pub fn bytes(&self) -> Result<Bytes, UnitError> {
        match self {
            SizeValue::Bytes(b) => Ok(Bytes(*b)),
            SizeValue::Text(t) => parse_size(t),
            SizeValue::Invalid(v) => Err(UnitError::NotWholeBytes { input: v.clone() }),
        }
    }
}

impl<'de> Deserialize<'de> for SizeValue {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = SizeValue;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "a size: a whole number of bytes >= 0 (e.g. 65536) or a string with a unit (e.g. \"64KiB\")",
                )
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<SizeValue, E> {
                Ok(SizeValue::Bytes(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<SizeValue, E> {
                Ok(u64::try_from(v)
                    .map_or_else(|_| SizeValue::Invalid(v.to_string()), SizeValue::Bytes))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<SizeValue, E> {
                Ok(SizeValue::Invalid(format!("{v:?}")))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<SizeValue, E> {
                Ok(SizeValue::Text(v.to_string()))
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
    fn parses_units() {
        assert_eq!(parse_size("1500"), Ok(Bytes(1500)));
        assert_eq!(parse_size("1500B"), Ok(Bytes(1500)));
        assert_eq!(parse_size("64KiB"), Ok(Bytes(65536)));
        assert_eq!(parse_size(" 64 kib "), Ok(Bytes(65536)));
        assert_eq!(parse_size("64KB"), Ok(Bytes(64000)));
        assert_eq!(parse_size("64K"), Ok(Bytes(64000)));
        assert_eq!(parse_size("2MiB"), Ok(Bytes(2 << 20)));
        assert_eq!(parse_size("1GiB"), Ok(Bytes(1 << 30)));
        assert!(matches!(parse_size("KiB"), Err(UnitError::NotASize { .. })));
        assert!(matches!(parse_size(""), Err(UnitError::NotASize { .. })));
        assert!(matches!(parse_size("-5"), Err(UnitError::NotASize { .. })));
        assert!(matches!(
            parse_size("1.5KiB"),
            Err(UnitError::UnknownUnit { .. })
        ));
        assert!(matches!(
            parse_size("64KiBs"),
            Err(UnitError::UnknownUnit { .. })
        ));
        assert!(matches!(
            parse_size("99999999999999999999"),
            Err(UnitError::Overflow { .. })
        ));
        assert!(matches!(
            parse_size("20000000000GiB"),
            Err(UnitError::Overflow { .. })
        ));
    }

    #[test]
    fn formats_shortest_exact() {
        assert_eq!(Bytes(65536).to_string(), "64KiB");
        assert_eq!(Bytes(3 << 20).to_string(), "3MiB");
        assert_eq!(Bytes(1500).to_string(), "1500B");
        assert_eq!(Bytes(0).to_string(), "0B");
        assert_eq!(Bytes(3302912).to_string(), "3302912B");
        assert_eq!(Bytes(13945824).to_string(), "13945824B");
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human_size(64 << 20), "64.0MiB");
        assert_eq!(human_size(1500), "1.5KiB");
        assert_eq!(human_size(1000), "1000B");
        assert_eq!(human_size(3 << 30), "3.0GiB");
    }

    #[test]
    fn cells_round_up() {
        let c = Bytes(96); // Spectrum-1
        assert_eq!(Bytes(65536).to_cells_ceil(c), Cells(683));
        assert_eq!(Bytes(65536).round_up_to_cells(c), Some(Bytes(65568)));
        assert_eq!(Bytes(96).to_cells_ceil(c), Cells(1));
        assert_eq!(Bytes(97).to_cells_ceil(c), Cells(2));
        assert_eq!(Bytes(0).to_cells_ceil(c), Cells(0));
        assert_eq!(Bytes(u64::MAX).round_up_to_cells(c), None);
        assert_eq!(Bytes(65537).to_kilobytes_ceil(), Kilobytes(65));
        assert_eq!(Bytes(65536).to_kilobytes_ceil(), Kilobytes(64));
        assert_eq!(Kilobytes(u64::MAX).to_bytes(), None);
    }

    #[test]
    fn size_values_deserialise_every_number() {
        let v = |t: &str| serde_json::from_str::<SizeValue>(t);
        assert_eq!(v("65536").unwrap(), SizeValue::Bytes(65536));
        assert_eq!(v("\"64KiB\"").unwrap().bytes(), Ok(Bytes(65536)));
        assert_eq!(v("-5").unwrap(), SizeValue::Invalid("-5".into()));
        assert_eq!(v("1.5").unwrap(), SizeValue::Invalid("1.5".into()));
        let e = v("-5").unwrap().bytes().unwrap_err().to_string();
        assert!(
            e.contains("-5 is not a size") && e.contains("\"64KiB\""),
            "{e}"
        );
        let e = v("[1]").unwrap_err().to_string();
        assert!(e.contains("a whole number of bytes"), "{e}");
        let e = toml::from_str::<std::collections::BTreeMap<String, SizeValue>>("x = true")
            .unwrap_err()
            .to_string();
        assert!(e.contains("a whole number of bytes"), "{e}");
    }

    proptest! {
        #[test]
        fn format_parse_round_trip(n in any::<u64>()) {
            let b = Bytes(n);
            prop_assert_eq!(parse_size(&b.to_string()), Ok(b));
        }

        #[test]
        fn cells_bytes_round_trip(n in 0u64..1 << 40, ai in 0usize..3) {
            // The cell sizes of Spectrum-1, Spectrum-2/3 and Spectrum-4/5.
            let cell = Bytes([96, 144, 192][ai]);
            // cells -> bytes -> cells is the identity
            let bytes = Cells(n).to_bytes(cell).unwrap();
            prop_assert_eq!(bytes.to_cells_ceil(cell), Cells(n));
            // bytes -> cells (ceil) -> bytes is the smallest cell multiple >= bytes
            let up = Bytes(n).round_up_to_cells(cell).unwrap();
            prop_assert!(up >= Bytes(n));
            prop_assert!(up.0 - n < cell.0);
            prop_assert_eq!(up.0 % cell.0, 0);
            prop_assert_eq!(up.round_up_to_cells(cell), Some(up));
        }

        #[test]
        fn kilobytes_round_trip(n in 0u64..1 << 50) {
            prop_assert_eq!(Kilobytes(n).to_bytes().unwrap().to_kilobytes_ceil(), Kilobytes(n));
            let kb = Bytes(n).to_kilobytes_ceil();
            let back = kb.to_bytes().unwrap();
            prop_assert!(back >= Bytes(n) && back.0 - n < BYTES_PER_KB);
        }
    }
}
