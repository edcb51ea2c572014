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

use capk_api::v1alpha1::{KVMCluster, KVMMachine};
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
    registry::Registry,
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
    /// `status.initialization.provisioned`.
    fn provisioned(&self) -> bool;
}

impl ObjectState for KVMMachine {
    fn provisioned(&self) -> bool {
        self.status
            .as_ref()
            .and_then(|s| s.initialization.as_ref())
            .and_then(|i| i.provisioned)
            .unwrap_or(false)
    }
}

impl ObjectState for KVMCluster {
    fn provisioned(&self) -> bool {
        self.status
            .as_ref()
            .and_then(|s| s.initialization.as_ref())
            .and_then(|i| i.provisioned)
            .unwrap_or(false)
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
    // controller-runtime's.
    reconcile_total: Family<ResultLabels, Counter>,
    reconcile_errors: Family<ControllerLabel, Counter>,
    reconcile_time: Family<ControllerLabel, Histogram>,
    max_concurrent: Family<ControllerLabel, Gauge>,
    active_workers: Family<ControllerLabel, Gauge>,
    work_duration: Family<QueueLabels, Histogram>,
    unfinished_work: Family<QueueLabels, Gauge<f64, AtomicU64>>,
    longest_running: Family<QueueLabels, Gauge<f64, AtomicU64>>,
    requests: Family<RequestLabels, Counter>,
    // The provider's own.
    errors: Family<ErrorLabels, Counter>,
    created: Family<ObjectLabels, Gauge>,
    deleted: Family<ObjectLabels, Gauge>,
    reconciled: Family<ObjectLabels, Gauge>,
    provisioned: Family<ObjectLabels, Gauge>,
    controllers: Mutex<Vec<&'static str>>,
    in_flight: InFlight,
    process: process::Process,
    ready: AtomicBool,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let reconcile_total = Family::<ResultLabels, Counter>::default();
        let reconcile_errors = Family::<ControllerLabel, Counter>::default();
        let reconcile_time = Family::<ControllerLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(RECONCILE_BUCKETS)
        });
        let max_concurrent = Family::<ControllerLabel, Gauge>::default();
        let active_workers = Family::<ControllerLabel, Gauge>::default();
        // client-go's work-queue buckets: 10 ns to 1000 s.
        let work_duration = Family::<QueueLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(10e-9, 10.0, 12))
        });
        let unfinished_work = Family::<QueueLabels, Gauge<f64, AtomicU64>>::default();
        let longest_running = Family::<QueueLabels, Gauge<f64, AtomicU64>>::default();
        let requests = Family::<RequestLabels, Counter>::default();
        // Counters get `_total` appended when encoded.
        registry.register(
            "controller_runtime_reconcile",
            "Total number of reconciliations per controller",
            reconcile_total.clone(),
        );
        registry.register(
            "controller_runtime_reconcile_errors",
            "Total number of reconciliation errors per controller",
            reconcile_errors.clone(),
        );
        registry.register(
            "controller_runtime_reconcile_time_seconds",
            "Length of time per reconciliation per controller",
            reconcile_time.clone(),
        );
        registry.register(
            "controller_runtime_max_concurrent_reconciles",
            "Maximum number of concurrent reconciles per controller",
            max_concurrent.clone(),
        );
        registry.register(
            "controller_runtime_active_workers",
            "Number of currently used workers per controller",
            active_workers.clone(),
        );
        registry.register(
            "workqueue_work_duration_seconds",
            "How long in seconds processing an item from workqueue takes.",
            work_duration.clone(),
        );
        registry.register(
            "workqueue_unfinished_work_seconds",
            "How many seconds of work has been done that is in progress and hasn't been \
             observed by work_duration.",
            unfinished_work.clone(),
        );
        registry.register(
            "workqueue_longest_running_processor_seconds",
            "How many seconds has the longest running processor for workqueue been running.",
            longest_running.clone(),
        );
        registry.register(
            "rest_client_requests",
            "Number of HTTP requests, partitioned by status code, method, and host.",
            requests.clone(),
        );
        let errors = Family::<ErrorLabels, Counter>::default();
        let created = Family::<ObjectLabels, Gauge>::default();
        let deleted = Family::<ObjectLabels, Gauge>::default();
        let reconciled = Family::<ObjectLabels, Gauge>::default();
        let provisioned = Family::<ObjectLabels, Gauge>::default();
        registry.register(
            "capk_reconcile_errors",
            "Failed reconciles by kind and category (waits included: their categories start \
             with Waiting)",
            errors.clone(),
        );
        registry.register(
            "capk_object_creation_timestamp_seconds",
            "Creation time of each reconciled object (Unix seconds)",
            created.clone(),
        );
        registry.register(
            "capk_object_deletion_timestamp_seconds",
            "Deletion time of each object being deleted (Unix seconds)",
            deleted.clone(),
        );
        registry.register(
            "capk_object_last_reconciled_timestamp_seconds",
            "When each object was last reconciled (Unix seconds)",
            reconciled.clone(),
        );
        registry.register(
            "capk_object_provisioned",
            "1 when the object's status.initialization.provisioned is true, as last reconciled",
            provisioned.clone(),
        );
        let process = process::Process::register(&mut registry);
        Self {
            registry,
            reconcile_total,
            reconcile_errors,
            reconcile_time,
            max_concurrent,
            active_workers,
            work_duration,
            unfinished_work,
            longest_running,
            requests,
            errors,
            created,
            deleted,
            reconciled,
            provisioned,
            controllers: Mutex::default(),
            in_flight: InFlight::default(),
            process,
            ready: AtomicBool::new(false),
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
                m.reconcile_total
                    .get_or_create(&ResultLabels { controller, result })
                    .inc_by(0);
            }
            m.reconcile_errors.get_or_create(&label).inc_by(0);
            m.max_concurrent
                .get_or_create(&label)
                .set(i64::from(concurrency));
            m.active_workers.get_or_create(&label).set(0);
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
        self.active_workers
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
        self.reconcile_total
            .get_or_create(&ResultLabels { controller, result })
            .inc();
        if result == "error" {
            self.reconcile_errors
                .get_or_create(&ControllerLabel { controller })
                .inc();
        }
    }

    /// Counts a failed reconcile of `kind` by its error's category.
    pub fn failed(&self, kind: &'static str, category: &'static str) {
        self.errors
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
            self.created.remove(&labels);
            self.deleted.remove(&labels);
            self.reconciled.remove(&labels);
            self.provisioned.remove(&labels);
            return;
        }
        let secs = |t: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time| t.0.as_second();
        if let Some(t) = &obj.creation_timestamp {
            self.created.get_or_create(&labels).set(secs(t));
        }
        if let Some(t) = &obj.deletion_timestamp {
            self.deleted.get_or_create(&labels).set(secs(t));
        }
        self.provisioned
            .get_or_create(&labels)
            .set(i64::from(provisioned));
        self.reconciled
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
            self.unfinished_work.get_or_create(&labels).set(sum);
            self.longest_running.get_or_create(&labels).set(longest);
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
        m.active_workers.get_or_create(&label).dec();
        m.reconcile_time.get_or_create(&label).observe(elapsed);
        m.work_duration
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
