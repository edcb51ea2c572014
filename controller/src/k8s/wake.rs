//! Wakes the reconciles of one kind from what other watches see (a workload cluster's Nodes, a
//! hosting cluster's objects, machine Pods): the sending side of a channel that the kind's
//! controller reads as triggers besides its own watch. Each reconciler adds the ways it is woken
//! in its `watches.rs`.

use futures::channel::mpsc::{UnboundedReceiver, UnboundedSender, unbounded};
use kube::runtime::reflector::ObjectRef;

/// Wakes reconciles of `K`.
pub struct Wake<K: kube::Resource<DynamicType = ()>>(UnboundedSender<ObjectRef<K>>);

impl<K: kube::Resource<DynamicType = ()>> Clone for Wake<K> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<K: kube::Resource<DynamicType = ()>> Wake<K> {
    /// A wake, and the reconciles it asks for (for the controller's triggers).
    pub fn new() -> (Self, UnboundedReceiver<ObjectRef<K>>) {
        let (tx, rx) = unbounded();
        (Self(tx), rx)
    }

    /// Asks for a reconcile of each of `refs`; once the controller is gone, nothing.
    pub fn all(&self, refs: impl IntoIterator<Item = ObjectRef<K>>) {
        for r in refs {
            let _ = self.0.unbounded_send(r);
        }
    }
}
