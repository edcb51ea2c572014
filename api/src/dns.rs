//! DNS names as Kubernetes and resolvers take them: what a guest's hostname, a search domain or
//! an object name must be. One definition for the CRD's neighbours (the controller's validation)
//! and the launch contract's check.

/// A DNS label: 1-63 of `[a-z0-9-]` (`lowercase`) or `[A-Za-z0-9-]`, not starting or ending
/// with `-`.
pub fn is_label(s: &str, lowercase: bool) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.chars().all(|c| {
            c.is_ascii_digit()
                || c == '-'
                || if lowercase {
                    c.is_ascii_lowercase()
                } else {
                    c.is_ascii_alphabetic()
                }
        })
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// A DNS name of labels in any case, at most 253 characters (a search domain).
pub fn is_name(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(|l| is_label(l, false))
}

/// A DNS subdomain as Kubernetes names objects: lower-case labels, at most 253 characters (also
/// what a guest's hostname must be).
pub fn is_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(|l| is_label(l, true))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subdomains_are_lower_case_labels_and_names_any_case() {
        assert!(is_subdomain("demo-cp-0.team-a"));
        assert!(!is_subdomain("Demo"));
        assert!(is_name("Example.ORG"));
        for bad in ["", "-a", "a-", "a..b", "a_b"] {
            assert!(!is_subdomain(bad) && !is_name(bad), "{bad:?}");
        }
        assert!(!is_subdomain(&"a".repeat(64)));
        assert!(!is_subdomain(&["a"; 128].join(".")));
    }
}
