//! Sizes written as Kubernetes quantities (`1Gi`, `512Mi`, `20G`, `1073741824`).
//!
//! The CRD accepts an integer or a string (like `resource.Quantity`), so `disk: 20Gi` and
//! `disk: 21474836480` both work; CEL rules in the schema check the value is a quantity and large
//! enough. [`SizeQuantity::bytes`] turns it into a byte count for the launcher.
//!
//! [`parse_bytes`] is the project's only quantity parser: the controller reads spec sizes with
//! it and the launcher its `--memory` and disk size flags, so a size one accepts the other does
//! too.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A size in bytes, written as a Kubernetes quantity (e.g. `1Gi`, `512Mi`, `20G`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SizeQuantity(pub String);

/// Why a quantity could not be turned into bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    /// "{0}" is not a Kubernetes quantity (examples: 1Gi, 512Mi, 20G)
    #[error("{0:?} is not a Kubernetes quantity (examples: 1Gi, 512Mi, 20G)")]
    Syntax(String),
    /// The quantity does not fit in 64 bits of bytes or has a fractional byte count.
    #[error("{0:?} is not a whole number of bytes that fits in 64 bits")]
    Range(String),
}

impl SizeQuantity {
    /// Builds a quantity from its string form, e.g. `SizeQuantity::from("1Gi")`.
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }

    /// The size in bytes. Fractional results round up (as Kubernetes does for resources).
    pub fn bytes(&self) -> Result<u64, QuantityError> {
        parse_bytes(&self.0)
    }
}

impl From<&str> for SizeQuantity {
    fn from(s: &str) -> Self {
        Self(s.to_owned())
    }
}

impl fmt::Display for SizeQuantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for SizeQuantity {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for SizeQuantity {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum IntOrString {
            Int(i64),
            Float(f64),
            String(String),
        }
        Ok(match IntOrString::deserialize(d)? {
            IntOrString::Int(i) => Self(i.to_string()),
            IntOrString::Float(f) => Self(f.to_string()),
            IntOrString::String(s) => Self(s),
        })
    }
}

#[cfg(feature = "kube")]
impl schemars::JsonSchema for SizeQuantity {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "SizeQuantity".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "A size as a Kubernetes quantity, e.g. 1Gi, 512Mi or 20G.",
            "x-kubernetes-int-or-string": true,
        })
    }
}

/// Parses a Kubernetes quantity into bytes, rounding fractions up.
pub fn parse_bytes(input: &str) -> Result<u64, QuantityError> {
    let syntax = || QuantityError::Syntax(input.to_owned());
    let range = || QuantityError::Range(input.to_owned());
    let s = input.trim();
    let s = s.strip_prefix('+').unwrap_or(s);
    if s.starts_with('-') {
        return Err(range());
    }
    let num_end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(num_end);
    if number.is_empty() || number == "." || number.matches('.').count() > 1 {
        return Err(syntax());
    }
    let (int_part, frac_part) = number.split_once('.').unwrap_or((number, ""));
    // Scale = multiplier as (numerator, power of ten) so decimal exponents stay exact.
    let (mult, exp10): (u128, i32) = match suffix {
        "" => (1, 0),
        "Ki" => (1 << 10, 0),
        "Mi" => (1 << 20, 0),
        "Gi" => (1 << 30, 0),
        "Ti" => (1 << 40, 0),
        "Pi" => (1 << 50, 0),
        "Ei" => (1 << 60, 0),
        "n" => (1, -9),
        "u" => (1, -6),
        "m" => (1, -3),
        "k" => (1, 3),
        "M" => (1, 6),
        "G" => (1, 9),
        "T" => (1, 12),
        "P" => (1, 15),
        "E" => (1, 18),
        other => {
            let exp = other
                .strip_prefix('e')
                .or_else(|| other.strip_prefix('E'))
                .ok_or_else(syntax)?;
            let exp: i32 = exp.parse().map_err(|_| syntax())?;
            if !(-30..=30).contains(&exp) {
                return Err(range());
            }
            (1, exp)
        }
    };
    if int_part.len() + frac_part.len() > 30 {
        return Err(range());
    }
    let digits: u128 = format!("{int_part}{frac_part}")
        .parse()
        .map_err(|_| syntax())?;
    let exp10 = exp10 - frac_part.len() as i32;
    let scaled = digits.checked_mul(mult).ok_or_else(range)?;
    let value = if exp10 >= 0 {
        scaled
            .checked_mul(10u128.checked_pow(exp10 as u32).ok_or_else(range)?)
            .ok_or_else(range)?
    } else {
        let div = 10u128.checked_pow((-exp10) as u32).ok_or_else(range)?;
        scaled.div_ceil(div)
    };
    u64::try_from(value).map_err(|_| range())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_forms_users_write() {
        assert_eq!(parse_bytes("1Gi"), Ok(1 << 30));
        assert_eq!(parse_bytes("512Mi"), Ok(512 << 20));
        assert_eq!(parse_bytes("20G"), Ok(20_000_000_000));
        assert_eq!(parse_bytes("1.5Gi"), Ok(1536 << 20));
        assert_eq!(parse_bytes("1073741824"), Ok(1 << 30));
        assert_eq!(parse_bytes("1e3"), Ok(1000));
        assert_eq!(parse_bytes("+2k"), Ok(2000));
        // Kubernetes rounds sub-unit quantities up.
        assert_eq!(parse_bytes("1500m"), Ok(2));
        // Every suffix Kubernetes knows (CEL's isQuantity admits them all).
        assert_eq!(parse_bytes("1u"), Ok(1));
        assert_eq!(parse_bytes("5n"), Ok(1));
        assert_eq!(parse_bytes("1Pi"), Ok(1 << 50));
        assert_eq!(parse_bytes("2E"), Ok(2_000_000_000_000_000_000));
    }

    #[test]
    fn rejects_what_is_not_a_size() {
        for bad in ["", "Gi", "1GB", "abc", "1..2", "1Gi1", "."] {
            assert_eq!(
                parse_bytes(bad),
                Err(QuantityError::Syntax(bad.into())),
                "{bad}"
            );
        }
        assert_eq!(
            parse_bytes("-1Gi"),
            Err(QuantityError::Range("-1Gi".into()))
        );
        assert_eq!(
            parse_bytes("20Ei"),
            Err(QuantityError::Range("20Ei".into()))
        );
    }

    #[test]
    fn deserializes_integers_and_strings() {
        let q: SizeQuantity = serde_json::from_str("1024").unwrap();
        assert_eq!(q.bytes(), Ok(1024));
        let q: SizeQuantity = serde_json::from_str("\"5Gi\"").unwrap();
        assert_eq!(q.bytes(), Ok(5 << 30));
        assert_eq!(serde_json::to_string(&q).unwrap(), "\"5Gi\"");
    }
}
