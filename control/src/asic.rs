//! Switch ASICs whose buffer cell size is known: thresholds are applied in whole cells
//! (sizes and cells themselves are `gradwire_units`).

use std::fmt;
use std::str::FromStr;

use gradwire_units::Bytes;

/// An ASIC name that is not one of [`Asic::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown ASIC {input:?} (known: spectrum1, spectrum2, spectrum3, spectrum4, spectrum5)")]
pub struct UnknownAsic {
    /// What was given.
    pub input: String,
}

/// Switch ASICs with a known buffer cell size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Asic {
    /// NVIDIA Spectrum-1 (SN2100, SN2410, SN2700): 96-byte cells.
    Spectrum1,
    /// Spectrum-2: 144-byte cells.
    Spectrum2,
    /// Spectrum-3: 144-byte cells.
    Spectrum3,
    /// Spectrum-4: 192-byte cells.
    Spectrum4,
    /// Spectrum-5: 192-byte cells.
    Spectrum5,
}

impl Asic {
    /// Every known ASIC.
    pub const ALL: [Asic; 5] = [
        Asic::Spectrum1,
        Asic::Spectrum2,
        Asic::Spectrum3,
        Asic::Spectrum4,
        Asic::Spectrum5,
    ];

    /// The buffer cell size: thresholds are applied in whole cells.
    pub const fn cell_size(self) -> Bytes {
        match self {
            Asic::Spectrum1 => Bytes(96),
            Asic::Spectrum2 | Asic::Spectrum3 => Bytes(144),
            Asic::Spectrum4 | Asic::Spectrum5 => Bytes(192),
        }
    }

    /// The name used on the command line and in files.
    pub const fn name(self) -> &'static str {
        match self {
            Asic::Spectrum1 => "spectrum1",
            Asic::Spectrum2 => "spectrum2",
            Asic::Spectrum3 => "spectrum3",
            Asic::Spectrum4 => "spectrum4",
            Asic::Spectrum5 => "spectrum5",
        }
    }
}

impl fmt::Display for Asic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Asic {
    type Err = UnknownAsic;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let norm: String = s
            .trim()
            .to_ascii_lowercase()
            .chars()
            .filter(|c| *c != '-' && *c != '_' && *c != ' ')
            .collect();
        Asic::ALL
            .into_iter()
            .find(|a| a.name() == norm)
            .ok_or_else(|| UnknownAsic { input: s.into() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asic_names() {
        for a in Asic::ALL {
            assert_eq!(a.name().parse::<Asic>(), Ok(a));
            assert_eq!(a.to_string(), a.name());
        }
        assert_eq!("Spectrum-2".parse::<Asic>(), Ok(Asic::Spectrum2));
        assert_eq!(Asic::Spectrum3.cell_size(), Bytes(144));
        assert_eq!(Asic::Spectrum5.cell_size(), Bytes(192));
        assert!("tomahawk".parse::<Asic>().is_err());
    }
}
