//! Prometheus metrics and the health endpoints (`/metrics`, `/healthz`, `/readyz`, `/version`).

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Instant,
};

use axum::{Router, extract::State, http::StatusCode, response::IntoResponse, routing::get};
use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

/// Labels of the reconcile metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// `KVMCluster` or `KVMMachine`.
    pub kind: &'static str,
}

/// Labels of the per-object gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ObjectLabels {
    /// `KVMCluster` or `KVMMachine`.
    pub kind: &'static str,
    /// The object's namespace.
    pub namespace: String,
    /// The object's name.
    pub name: String,
}

/// Labels of the error counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// `KVMCluster` or `KVMMachine`.
    pub kind: &'static str,
    /// The error's category ([`crate::error::Error::category`]).
    pub category: &'static str,
}

/// The controller's metrics.
pub struct Metrics {
    registry: Registry,
    reconciles: Family<KindLabel, Counter>,
    errors: Family<ErrorLabels, Counter>,
    duration: Family<KindLabel, Histogram>,
    created: Family<ObjectLabels, Gauge>,
    deleted: Family<ObjectLabels, Gauge>,
    reconciled: Family<ObjectLabels, Gauge>,
    ready: AtomicBool,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("capk");
        let reconciles = Family::<KindLabel, Counter>::default();
        let errors = Family::<ErrorLabels, Counter>::default();
        let duration = Family::<KindLabel, Histogram>::new_with_constructor(|| {
            Histogram::new([0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0])
        });
        registry.register(
            "reconciles",
            "Finished reconciles by kind",
            reconciles.clone(),
        );
        registry.register(
            "reconcile_errors",
            "Failed reconciles by kind and category",
            errors.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Reconcile duration by kind",
            duration.clone(),
        );
        let created = Family::<ObjectLabels, Gauge>::default();
        let deleted = Family::<ObjectLabels, Gauge>::default();
        let reconciled = Family::<ObjectLabels, Gauge>::default();
        registry.register(
            "object_creation_timestamp_seconds",
            "Creation time of each reconciled object (Unix seconds)",
            created.clone(),
        );
        registry.register(
            "object_deletion_timestamp_seconds",
            "Deletion time of each object being deleted (Unix seconds)",
            deleted.clone(),
        );
        registry.register(
            "object_last_reconciled_timestamp_seconds",
            "When each object was last reconciled (Unix seconds)",
            reconciled.clone(),
        );
        Self {
            registry,
            reconciles,
            errors,
            duration,
            created,
            deleted,
            reconciled,
            ready: AtomicBool::new(false),
        }
    }
}

impl Metrics {
    /// Starts timing a reconcile of `kind`; the reconcile is counted, and its duration
    /// observed, together when it finishes, so a scrape never sees one without the other.
    pub fn start(&self, kind: &'static str) -> ReconcileTimer<'_> {
        ReconcileTimer {
            metrics: self,
            kind,
            start: Instant::now(),
        }
    }

    /// Counts a failed reconcile.
    pub fn failed(&self, kind: &'static str, category: &'static str) {
        self.errors
            .get_or_create(&ErrorLabels { kind, category })
            .inc();
    }

    /// Records the per-object gauges after a reconcile of `obj`. `gone`: its deletion finished
    /// (our finalizer is off), so its series are dropped rather than kept forever.
    pub fn object(
        &self,
        kind: &'static str,
        obj: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
        gone: bool,
    ) {
        let labels = ObjectLabels {
            kind,
            namespace: obj.namespace.clone().unwrap_or_default(),
            name: obj.name.clone().unwrap_or_default(),
        };
        if gone {
            self.created.remove(&labels);
            self.deleted.remove(&labels);
            self.reconciled.remove(&labels);
            return;
        }
        let secs = |t: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time| t.0.as_second();
        if let Some(t) = &obj.creation_timestamp {
            self.created.get_or_create(&labels).set(secs(t));
        }
        if let Some(t) = &obj.deletion_timestamp {
            self.deleted.get_or_create(&labels).set(secs(t));
        }
        self.reconciled
            .get_or_create(&labels)
            .set(k8s_openapi::jiff::Timestamp::now().as_second());
    }

    /// Marks the controller ready (watches started).
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::SeqCst);
    }

    fn render(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

/// Records a reconcile's duration when dropped.
pub struct ReconcileTimer<'a> {
    metrics: &'a Metrics,
    kind: &'static str,
    start: Instant,
}

impl Drop for ReconcileTimer<'_> {
    fn drop(&mut self) {
        let kind = KindLabel { kind: self.kind };
        self.metrics.reconciles.get_or_create(&kind).inc();
        self.metrics
            .duration
            .get_or_create(&kind)
            .observe(self.start.elapsed().as_secs_f64());
    }
}

async fn metrics(State(m): State<Arc<Metrics>>) -> impl IntoResponse {
    (
        [(
            "content-type",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        m.render(),
    )
}

async fn readyz(State(m): State<Arc<Metrics>>) -> impl IntoResponse {
    if m.ready.load(Ordering::SeqCst) {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting")
    }
}

/// The HTTP routes: `/metrics`, `/healthz`, `/readyz`, `/version`.
pub fn router(m: Arc<Metrics>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/version", get(|| async { env!("CARGO_PKG_VERSION") }))
        .with_state(m)
}
