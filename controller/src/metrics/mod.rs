//! The controller's Prometheus metrics. Reconciles are counted under controller-runtime's names
//! and labels (`controller_runtime_reconcile_total{controller,result}` and the rest), which is
//! what Cluster API's Grafana dashboards query; the kube client's requests are
//! `rest_client_requests_total{code,method,host}` ([`rest_client`]); the process's are
//! `process_*`; the provider's own per-object gauges are `capk_*`. [`serve`] serves them
//! (HTTPS with TokenReview and SubjectAccessReview, or plain HTTP behind a flag) and the health
//! endpoints.
//!
//! kube-runtime's scheduler keeps its queue to itself, so of controller-runtime's work-queue
//! metrics only those measurable around a reconcile exist here: work duration, unfinished work
//! and the longest running reconcile. Queue depth, adds and queue latency have no equivalent.

mod process;
pub mod rest_client;
pub mod serve;

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Instant,
};

use capk_api::v1alpha1::{Initialization, KVMCluster, KVMMachine};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::controller::Action;
use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::{Metric, Registry},
};

use crate::runtime::error::Error;

/// The controllers' names, as controller-runtime names its own (the kind, lowercase): the
/// `controller` label of the reconcile metrics and the `name` of the work-queue metrics.
pub const KVMCLUSTER: &str = "kvmcluster";
/// See [`KVMCLUSTER`].
pub const KVMMACHINE: &str = "kvmmachine";
/// See [`KVMCLUSTER`].
pub const KVMMACHINETEMPLATE: &str = "kvmmachinetemplate";

/// controller-runtime's reconcile results: `success` (nothing to do until a change),
/// `requeue_after` (look again later, including a step that waits for something a condition
/// shows) and `error`.
const RESULTS: [&str; 4] = ["success", "requeue_after", "requeue", "error"];

/// controller-runtime's buckets of `controller_runtime_reconcile_time_seconds`.
const RECONCILE_BUCKETS: [f64; 40] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7, 0.8, 0.9,
    1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 15.0, 20.0,
    25.0, 30.0, 40.0, 50.0, 60.0,
];

/// Label of the per-controller metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabel {
    /// [`KVMCLUSTER`], [`KVMMACHINE`] or [`KVMMACHINETEMPLATE`].
    pub controller: &'static str,
}

/// Labels of `controller_runtime_reconcile_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// The controller.
    pub controller: &'static str,
    /// One of controller-runtime's results: `success`, `requeue_after`, `requeue`, `error`.
    pub result: &'static str,
}

/// Labels of the work-queue metrics (controller-runtime's: the queue is named after its
/// controller).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabels {
    /// The queue: the controller's name.
    pub name: &'static str,
    /// The controller.
    pub controller: &'static str,
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
    /// The error's category ([`crate::runtime::error::Error::category`]).
    pub category: &'static str,
}

/// Labels of `rest_client_requests_total` (client-go's).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// HTTP status code, or `<error>` when no answer came.
    pub code: String,
    /// HTTP method.
    pub method: String,
    /// The apiserver's `host:port`.
    pub host: String,
}

/// What the per-object gauges read of an object besides its metadata.
pub trait ObjectState {
    /// `status.initialization`.
    fn initialization(&self) -> Option<&Initialization>;

    /// `status.initialization.provisioned`.
    fn provisioned(&self) -> bool {
        self.initialization()
            .and_then(|i| i.provisioned)
            .unwrap_or(false)
    }
}

impl ObjectState for KVMMachine {
    fn initialization(&self) -> Option<&Initialization> {
        self.status.as_ref()?.contract.initialization.as_ref()
    }
}

impl ObjectState for KVMCluster {
    fn initialization(&self) -> Option<&Initialization> {
        self.status.as_ref()?.contract.initialization.as_ref()
    }
}

/// The reconciles running now, for the work-queue gauges.
#[derive(Default)]
struct InFlight {
    next: AtomicU64,
    running: Mutex<HashMap<u64, (&'static str, Instant)>>,
}

/// The controller's metrics.
pub struct Metrics {
    registry: Registry,
    reconciles: ReconcileMetrics,
    queue: WorkQueueMetrics,
    /// client-go's `rest_client_requests_total`.
    requests: Family<RequestLabels, Counter>,
    provider: ProviderMetrics,
    controllers: Mutex<Vec<&'static str>>,
    in_flight: InFlight,
    process: process::Process,
    ready: AtomicBool,
}

/// controller-runtime's reconcile metrics, per controller.
struct ReconcileMetrics {
    total: Family<ResultLabels, Counter>,
    errors: Family<ControllerLabel, Counter>,
    time: Family<ControllerLabel, Histogram>,
    max_concurrent: Family<ControllerLabel, Gauge>,
    active_workers: Family<ControllerLabel, Gauge>,
}

/// controller-runtime's work-queue metrics that are measurable around a reconcile.
struct WorkQueueMetrics {
    work_duration: Family<QueueLabels, Histogram>,
    unfinished_work: Family<QueueLabels, Gauge<f64, AtomicU64>>,
    longest_running: Family<QueueLabels, Gauge<f64, AtomicU64>>,
}

/// The provider's own metrics (`capk_*`): errors by category and the per-object gauges.
struct ProviderMetrics {
    errors: Family<ErrorLabels, Counter>,
    created: Family<ObjectLabels, Gauge>,
    deleted: Family<ObjectLabels, Gauge>,
    reconciled: Family<ObjectLabels, Gauge>,
    provisioned: Family<ObjectLabels, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let reconciles = ReconcileMetrics::register(&mut registry);
        let queue = WorkQueueMetrics::register(&mut registry);
        let requests = register(
            &mut registry,
            "rest_client_requests",
            "Number of HTTP requests, partitioned by status code, method, and host.",
            Family::default(),
        );
        let provider = ProviderMetrics::register(&mut registry);
        let process = process::Process::register(&mut registry);
        Self {
            registry,
            reconciles,
            queue,
            requests,
            provider,
            controllers: Mutex::default(),
            in_flight: InFlight::default(),
            process,
            ready: AtomicBool::new(false),
        }
    }
}

/// Registers `metric` under `name` (a counter gets `_total` appended when encoded) and returns
/// it, to be kept and updated.
fn register<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register(name, help, metric.clone());
    metric
}

impl ReconcileMetrics {
    /// The metrics, registered under controller-runtime's names.
    fn register(r: &mut Registry) -> Self {
        Self {
            total: register(
                r,
                "controller_runtime_reconcile",
                "Total number of reconciliations per controller",
                Family::default(),
            ),
            errors: register(
                r,
                "controller_runtime_reconcile_errors",
                "Total number of reconciliation errors per controller",
                Family::default(),
            ),
            time: register(
                r,
                "controller_runtime_reconcile_time_seconds",
                "Length of time per reconciliation per controller",
                Family::new_with_constructor(|| Histogram::new(RECONCILE_BUCKETS)),
            ),
            max_concurrent: register(
                r,
                "controller_runtime_max_concurrent_reconciles",
                "Maximum number of concurrent reconciles per controller",
                Family::default(),
            ),
            active_workers: register(
                r,
                "controller_runtime_active_workers",
                "Number of currently used workers per controller",
                Family::default(),
            ),
        }
    }
}

impl WorkQueueMetrics {
    /// The metrics, registered under controller-runtime's names.
    fn register(r: &mut Registry) -> Self {
        Self {
            work_duration: register(
                r,
                "workqueue_work_duration_seconds",
                "How long in seconds processing an item from workqueue takes.",
                // client-go's work-queue buckets: 10 ns to 1000 s.
                Family::new_with_constructor(|| {
                    Histogram::new(exponential_buckets(10e-9, 10.0, 12))
                }),
            ),
            unfinished_work: register(
                r,
                "workqueue_unfinished_work_seconds",
                "How many seconds of work has been done that is in progress and hasn't been \
                 observed by work_duration.",
                Family::default(),
            ),
            longest_running: register(
                r,
                "workqueue_longest_running_processor_seconds",
                "How many seconds has the longest running processor for workqueue been running.",
                Family::default(),
            ),
        }
    }
}

impl ProviderMetrics {
    /// The metrics, registered under `capk_*` names.
    fn register(r: &mut Registry) -> Self {
        Self {
            errors: register(
                r,
                "capk_reconcile_errors",
                "Failed reconciles by kind and category (waits included: their categories start \
                 with Waiting)",
                Family::default(),
            ),
            created: register(
                r,
                "capk_object_creation_timestamp_seconds",
                "Creation time of each reconciled object (Unix seconds)",
                Family::default(),
            ),
            deleted: register(
                r,
                "capk_object_deletion_timestamp_seconds",
                "Deletion time of each object being deleted (Unix seconds)",
                Family::default(),
            ),
            reconciled: register(
                r,
                "capk_object_last_reconciled_timestamp_seconds",
                "When each object was last reconciled (Unix seconds)",
                Family::default(),
            ),
            provisioned: register(
                r,
                "capk_object_provisioned",
                "1 when the object's status.initialization.provisioned is true, as last reconciled",
                Family::default(),
            ),
        }
    }
}

/// The result label of a finished reconcile. A step that waits for something else (which a
/// condition shows) is an error only in form: controller-runtime reconcilers return
/// `RequeueAfter` for it, so it counts as `requeue_after`, not as an error.
fn result_label(result: &Result<Action, Error>) -> &'static str {
    match result {
        Ok(action) if *action == Action::await_change() => "success",
        Ok(_) => "requeue_after",
        Err(e) if e.is_waiting() => "requeue_after",
        Err(_) => "error",
    }
}

/// The controller (controller-runtime's name) that reconciles `kind`.
fn controller_of(kind: &str) -> &'static str {
    match kind {
        "KVMCluster" => KVMCLUSTER,
        "KVMMachine" => KVMMACHINE,
        "KVMMachineTemplate" => KVMMACHINETEMPLATE,
        _ => "unknown",
    }
}

impl Metrics {
    /// Metrics of controllers that run at most `concurrency` reconciles at once, each. The
    /// KVMCluster and KVMMachine controllers' series exist (at zero) from the start, as
    /// controller-runtime's do.
    pub fn new(concurrency: u16) -> Self {
        let m = Self::default();
        for controller in [KVMCLUSTER, KVMMACHINE] {
            let label = ControllerLabel { controller };
            for result in RESULTS {
                m.reconciles
                    .total
                    .get_or_create(&ResultLabels { controller, result })
                    .inc_by(0);
            }
            m.reconciles.errors.get_or_create(&label).inc_by(0);
            m.reconciles
                .max_concurrent
                .get_or_create(&label)
                .set(i64::from(concurrency));
            m.reconciles.active_workers.get_or_create(&label).set(0);
            m.controllers
                .lock()
                .expect("controllers lock")
                .push(controller);
        }
        m
    }

    /// Starts a reconcile of `kind`: an active worker until the returned value is dropped, when
    /// its duration is observed. [`Metrics::finished`] counts its result.
    pub fn start(self: &Arc<Self>, kind: &'static str) -> Run {
        let controller = controller_of(kind);
        let id = self.in_flight.next.fetch_add(1, Ordering::Relaxed);
        let start = Instant::now();
        self.in_flight
            .running
            .lock()
            .expect("in-flight lock")
            .insert(id, (controller, start));
        {
            let mut controllers = self.controllers.lock().expect("controllers lock");
            if !controllers.contains(&controller) {
                controllers.push(controller);
            }
        }
        self.reconciles
            .active_workers
            .get_or_create(&ControllerLabel { controller })
            .inc();
        Run {
            metrics: self.clone(),
            controller,
            id,
            start,
        }
    }

    /// Counts a finished reconcile of `kind` by controller-runtime's result.
    pub fn finished(&self, kind: &'static str, result: &Result<Action, Error>) {
        let controller = controller_of(kind);
        let result = result_label(result);
        self.reconciles
            .total
            .get_or_create(&ResultLabels { controller, result })
            .inc();
        if result == "error" {
            self.reconciles
                .errors
                .get_or_create(&ControllerLabel { controller })
                .inc();
        }
    }

    /// Counts a failed reconcile of `kind` by its error's category.
    pub fn failed(&self, kind: &'static str, category: &'static str) {
        self.provider
            .errors
            .get_or_create(&ErrorLabels { kind, category })
            .inc();
    }

    /// Counts one request of the kube client ([`rest_client`]).
    pub fn request(&self, code: String, method: &str, host: &str) {
        self.requests
            .get_or_create(&RequestLabels {
                code,
                method: method.to_owned(),
                host: host.to_owned(),
            })
            .inc();
    }

    /// Records the per-object gauges after a reconcile of `obj`. `gone`: its deletion finished
    /// (our finalizer is off), so its series are dropped rather than kept forever.
    pub fn object(&self, kind: &'static str, obj: &ObjectMeta, provisioned: bool, gone: bool) {
        let labels = ObjectLabels {
            kind,
            namespace: obj.namespace.clone().unwrap_or_default(),
            name: obj.name.clone().unwrap_or_default(),
        };
        if gone {
            self.provider.created.remove(&labels);
            self.provider.deleted.remove(&labels);
            self.provider.reconciled.remove(&labels);
            self.provider.provisioned.remove(&labels);
            return;
        }
        let secs = |t: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time| t.0.as_second();
        if let Some(t) = &obj.creation_timestamp {
            self.provider.created.get_or_create(&labels).set(secs(t));
        }
        if let Some(t) = &obj.deletion_timestamp {
            self.provider.deleted.get_or_create(&labels).set(secs(t));
        }
        self.provider
            .provisioned
            .get_or_create(&labels)
            .set(i64::from(provisioned));
        self.provider
            .reconciled
            .get_or_create(&labels)
            .set(k8s_openapi::jiff::Timestamp::now().as_second());
    }

    /// Marks the controller ready (watches started).
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::SeqCst);
    }

    /// Whether [`Metrics::set_ready`] was called.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    /// The metrics in OpenMetrics text format.
    pub fn render(&self) -> String {
        self.update_queue_gauges();
        self.process.update();
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }

    /// The gauges that describe the reconciles running now, as of this moment.
    fn update_queue_gauges(&self) {
        let now = Instant::now();
        let mut by_controller: HashMap<&'static str, (f64, f64)> = self
            .controllers
            .lock()
            .expect("controllers lock")
            .iter()
            .map(|c| (*c, (0.0, 0.0)))
            .collect();
        for (controller, start) in self
            .in_flight
            .running
            .lock()
            .expect("in-flight lock")
            .values()
        {
            let age = now.duration_since(*start).as_secs_f64();
            let (sum, longest) = by_controller.entry(*controller).or_default();
            *sum += age;
            *longest = longest.max(age);
        }
        for (controller, (sum, longest)) in by_controller {
            let labels = QueueLabels {
                name: controller,
                controller,
            };
            self.queue.unfinished_work.get_or_create(&labels).set(sum);
            self.queue
                .longest_running
                .get_or_create(&labels)
                .set(longest);
        }
    }
}

/// One reconcile while it runs ([`Metrics::start`]); its duration is observed when dropped.
pub struct Run {
    metrics: Arc<Metrics>,
    controller: &'static str,
    id: u64,
    start: Instant,
}

impl Drop for Run {
    fn drop(&mut self) {
        let m = &self.metrics;
        let controller = self.controller;
        let label = ControllerLabel { controller };
        let elapsed = self.start.elapsed().as_secs_f64();
        m.in_flight
            .running
            .lock()
            .expect("in-flight lock")
            .remove(&self.id);
        m.reconciles.active_workers.get_or_create(&label).dec();
        m.reconciles.time.get_or_create(&label).observe(elapsed);
        m.queue
            .work_duration
            .get_or_create(&QueueLabels {
                name: controller,
                controller,
            })
            .observe(elapsed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn reconciles_are_counted_under_controller_runtimes_names() {
        let m = Arc::new(Metrics::new(16));
        let results = [
            Ok(Action::await_change()),
            Ok(Action::await_change()),
            Ok(Action::requeue(std::time::Duration::from_secs(5))),
            Err(Error::MachinesRemain(1)),
            Err(Error::MissingNamespace),
        ];
        for result in &results {
            let _run = m.start("KVMMachine");
            m.finished("KVMMachine", result);
        }
        let text = m.render();
        let get = |s: &str| value(&text, s).unwrap_or_else(|| panic!("{s} missing in\n{text}"));
        let c = r#"controller="kvmmachine""#;
        let total = |result: &str| {
            get(&format!(
                "controller_runtime_reconcile_total{{{c},result=\"{result}\"}}"
            ))
        };
        assert_eq!(total("success"), 2.0);
        // A step that waits (a condition says for what) is requeue_after, as in a Go provider.
        assert_eq!(total("requeue_after"), 2.0);
        assert_eq!(total("error"), 1.0);
        assert_eq!(total("requeue"), 0.0);
        assert_eq!(
            get(&format!("controller_runtime_reconcile_errors_total{{{c}}}")),
            1.0
        );
        assert_eq!(
            get(&format!(
                "controller_runtime_reconcile_time_seconds_count{{{c}}}"
            )),
            5.0
        );
        assert_eq!(
            get(&format!(
                "controller_runtime_max_concurrent_reconciles{{{c}}}"
            )),
            16.0
        );
        assert_eq!(
            get(&format!("controller_runtime_active_workers{{{c}}}")),
            0.0
        );
        let q = r#"name="kvmmachine",controller="kvmmachine""#;
        assert_eq!(
            get(&format!("workqueue_work_duration_seconds_count{{{q}}}")),
            5.0
        );
        assert_eq!(
            get(&format!(
                "workqueue_longest_running_processor_seconds{{{q}}}"
            )),
            0.0
        );
        // The other controller's series are there, at zero, before its first reconcile.
        let c = r#"controller="kvmcluster""#;
        assert_eq!(
            get(&format!("controller_runtime_reconcile_errors_total{{{c}}}")),
            0.0
        );
    }

    #[test]
    fn a_running_reconcile_is_an_active_worker_with_unfinished_work() {
        let m = Arc::new(Metrics::new(4));
        let run = m.start("KVMCluster");
        std::thread::sleep(std::time::Duration::from_millis(50));
        let text = m.render();
        let c = r#"controller="kvmcluster""#;
        let q = r#"name="kvmcluster",controller="kvmcluster""#;
        let active = format!("controller_runtime_active_workers{{{c}}}");
        let longest = format!("workqueue_longest_running_processor_seconds{{{q}}}");
        let unfinished = format!("workqueue_unfinished_work_seconds{{{q}}}");
        assert_eq!(value(&text, &active), Some(1.0));
        assert!(value(&text, &longest).unwrap() >= 0.04, "{text}");
        assert!(value(&text, &unfinished).unwrap() >= 0.04, "{text}");
        drop(run);
        let text = m.render();
        assert_eq!(value(&text, &active), Some(0.0));
        assert_eq!(value(&text, &unfinished), Some(0.0));
    }

    #[test]
    fn an_object_whose_deletion_finished_leaves_no_series() {
        let m = Metrics::default();
        let meta: ObjectMeta = serde_json::from_value(serde_json::json!({
            "name": "m0", "namespace": "ns", "creationTimestamp": "2026-11-25T10:00:00Z"}))
        .unwrap();
        m.object("KVMMachine", &meta, true, false);
        let series = r#"capk_object_provisioned{kind="KVMMachine",namespace="ns",name="m0"}"#;
        assert_eq!(value(&m.render(), series), Some(1.0));
        m.object("KVMMachine", &meta, true, true);
        assert!(!m.render().contains("name=\"m0\""));
    }
}
