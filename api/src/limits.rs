//! The bounds of one machine, defined once. The KVMMachine CRD's CEL rules on `spec.resources`,
//! the controller's validation of a spec and `capk-launcher run`'s checks of its flags all read
//! them, so a spec the apiserver admits is one the controller builds and the launcher runs, and a
//! launcher flag the controller renders is one the launcher takes. Tests on each side hold them
//! to this module.

/// The fewest vCPUs a machine has.
pub const MIN_VCPUS: u32 = 1;
/// The most vCPUs a machine has: QEMU's x86 machine addresses vCPUs by 8-bit APIC IDs without
/// an interrupt-remapping IOMMU, which the launcher does not give a guest.
pub const MAX_VCPUS: u32 = 255;

/// A lower bound on a size, as a user writes it and in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SizeBound {
    /// The bound as a Kubernetes quantity (what messages say and CEL compares with).
    pub quantity: &'static str,
    /// The same bound in bytes.
    pub bytes: u64,
}

/// The least guest memory: Flatcar with containerd and a kubelet does not boot into a working
/// node below it (2Gi or more is what a real node wants).
pub const MIN_MEMORY: SizeBound = SizeBound {
    quantity: "256Mi",
    bytes: 256 << 20,
};

/// The smallest root disk: the qcow2 overlay the node image is grown to (never shrunk below
/// the image's own size, which the launcher checks once it has the image).
pub const MIN_DISK: SizeBound = SizeBound {
    quantity: "1Gi",
    bytes: 1 << 30,
};

/// A CEL rule with the message the apiserver returns when a value breaks it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CelRule {
    /// The rule, `self` being the field.
    pub rule: String,
    /// What the user reads.
    pub message: String,
}

/// `spec.resources.cpu` is at least [`MIN_VCPUS`].
pub fn cpu_min_rule() -> CelRule {
    CelRule {
        rule: format!("self >= {MIN_VCPUS}"),
        message: format!("cpu is the number of vCPUs and must be at least {MIN_VCPUS}"),
    }
}

/// `spec.resources.cpu` is at most [`MAX_VCPUS`].
pub fn cpu_max_rule() -> CelRule {
    CelRule {
        rule: format!("self <= {MAX_VCPUS}"),
        message: format!("cpu must be at most {MAX_VCPUS} (the most vCPUs a machine runs)"),
    }
}

/// `spec.resources.memory` is a quantity of at least [`MIN_MEMORY`].
pub fn memory_rule() -> CelRule {
    min_quantity_rule("memory", MIN_MEMORY, "1Gi")
}

/// `spec.resources.disk` is a quantity of at least [`MIN_DISK`].
pub fn disk_rule() -> CelRule {
    min_quantity_rule("disk", MIN_DISK, "20Gi")
}

fn min_quantity_rule(field: &str, min: SizeBound, example: &str) -> CelRule {
    CelRule {
        rule: format!(
            "isQuantity(string(self)) && quantity(string(self)).compareTo(quantity('{}')) >= 0",
            min.quantity
        ),
        message: format!(
            "{field} must be a quantity of at least {}, e.g. {example}",
            min.quantity
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quantity::parse_bytes;

    #[test]
    fn each_size_bound_says_the_same_in_both_units() {
        for b in [MIN_MEMORY, MIN_DISK] {
            assert_eq!(parse_bytes(b.quantity).unwrap(), b.bytes, "{b:?}");
        }
    }

    #[test]
    fn the_rules_name_their_bound() {
        assert_eq!(cpu_max_rule().rule, "self <= 255");
        assert!(memory_rule().rule.contains("quantity('256Mi')"));
        assert!(
            disk_rule()
                .message
                .starts_with("disk must be a quantity of at least 1Gi")
        );
    }
}
