# cluster-api-provider-kvm
SHELL := /usr/bin/env bash
CARGO ?= cargo
OUTPUT := _output

.PHONY: all build check check-no-local-mc packages test test-deps lint fmt generate release-manifests bench calibrate test-guest bench-controller bench-launcher bench-e2e bench-e2e-workload bench-idle-node bench-idle-nodes bench-dev-up testenv testenv-down dev-up dev-down e2e e2e-stub e2e-topology e2e-operating e2e-workload fuzz clean help node-image test-node-image

all: build

help: ## Show the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

build: ## Build every crate
	$(CARGO) build --workspace --all-targets

test-deps: ## Build/prepare what the tests need (upstream binaries, test guest); skips what exists
	bash hack/prepare-test-deps.sh

test: test-deps ## Run every test (unit, integration against a real kube-apiserver, launcher)
	$(CARGO) test --workspace --no-fail-fast

check: packages check-no-local-mc lint test ## What CI runs after installing packages (.ci/run): make lint, make test, then make e2e-stub on a local MC that is torn down afterwards, pass or fail (hack/e2e-gate.sh; root, no local MC running)
	bash hack/e2e-gate.sh

packages: ## The Debian packages a fresh machine lacks (root), and a check of the Go and Rust toolchains
	@bash hack/install-packages.sh

check-no-local-mc: # make check's journey needs the machine's one local MC: say at once when one runs
	@bash hack/e2e-gate.sh --precheck

lint: ## cargo fmt --check, clippy with warnings denied, shellcheck over every shell script
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	bash hack/lint-shell.sh

fmt: ## Format the code
	$(CARGO) fmt --all

generate: ## Regenerate manifests/crd from the Rust types
	$(CARGO) run -q -p capk-api --example crdgen -- manifests/crd

bench: bench-controller bench-launcher bench-e2e ## Every benchmark

calibrate: test-guest ## The host's TCG speed: the test guest's boot and fixed workload timed against the reference machine (docs/benchmarks.md), one line and _output/calibration.env; every emulation benchmark runs it first
	bash hack/calibrate-host.sh

test-guest: ## Only the launcher's test guest of make test-deps (images/test-guest), into _output/test-guest; skipped when up to date
	bash hack/prepare.d/40-test-guest.sh

bench-launcher: test-deps ## Launcher start-up, guest boot and RSS under QEMU (root, netns)
	bash hack/calibrate-host.sh
	$(CARGO) test -p capk-launcher --release --test vm_netns -- --ignored --nocapture bench

bench-controller: test-deps ## N KVMMachines (CAPK_BENCH_MACHINES, default 1000) against a real apiserver
	$(CARGO) bench -p capk-controller --bench controller

release-manifests: test-deps ## clusterctl repository files under _output/release/infrastructure-kvm/<version>
	@bash hack/release-manifests.sh

testenv: test-deps ## Start etcd + kube-apiserver with our CRDs in the background; last line = kubeconfig
	@bash hack/testenv.sh up

testenv-down: ## Stop the environment started by `make testenv`
	@bash hack/testenv.sh down

node-image: ## Kubernetes node image (images/node): _output/node-image/node.qcow2 and localhost/capk/node:<version>-<hash>
	bash images/node/build.sh

test-node-image: node-image ## Boot the node image under QEMU: Ignition, preloaded images, kubeadm init with no registry
	$(CARGO) test -p capk-launcher --test node_image -- --ignored --nocapture --skip bench_

bench-idle-node: node-image test-guest ## An idle control plane of the node-image flavor under TCG, watched from the host: time to every Pod ready, QEMU's host CPU over 60 s, the guest's split, apiserver requests/s (flavor variables from the environment; CAPK_BENCH_PERF=1 samples QEMU, CAPK_BENCH_PPROF=1 profiles the apiserver and kubelet into _output/bench/)
	bash hack/calibrate-host.sh
	$(CARGO) test -p capk-launcher --test node_image -- --ignored --nocapture --exact bench_idle_control_plane

dev-up: ## The local management cluster with Cluster API and CAPK (clusterctl init) and a sample workload cluster of the node image, two Nodes Ready (CAPK_DEV_SAMPLE=stub: the stand-in test guest; =0: none)
	bash hack/dev-up.sh

e2e: test-guest ## End to end on the local management cluster (make dev-up without the sample, with the VPA and Prometheus): the stub-guest journey (create, scale, upgrade, faults, pause, delete), the ClusterClass scenario (NodePort from the host, a variable rotates a template), the controller's metrics in Prometheus and the controller under the VPA, then a real workload cluster of the node image (Nodes Ready, CNI, DNS, host volume, delete)
	bash hack/calibrate-host.sh
	CAPK_DEV_SAMPLE=0 CAPK_DEV_VPA=1 CAPK_DEV_MONITORING=1 bash hack/dev-up.sh
	$(CARGO) test -p capk-tests --test e2e -- --ignored --nocapture --exact cluster_journey_on_the_local_management_cluster cluster_class_journey_on_the_local_management_cluster operating_the_controller_on_the_local_management_cluster workload_cluster_journey_on_the_local_management_cluster

e2e-stub: test-guest ## The stub-guest scenarios of make e2e: the journey and the ClusterClass scenario (the local MC without the sample cluster and the node image, which they do not use)
	bash hack/calibrate-host.sh
	CAPK_DEV_SAMPLE=0 CAPK_DEV_NODE_IMAGE=0 bash hack/dev-up.sh
	$(CARGO) test -p capk-tests --test e2e -- --ignored --nocapture --exact cluster_journey_on_the_local_management_cluster cluster_class_journey_on_the_local_management_cluster

e2e-topology: test-guest ## Only the ClusterClass scenario of make e2e-stub (stub guests): a Cluster of the class kvm with a NodePort control plane reached from the host through its kubeconfig, a changed variable that rotates the KVMMachineTemplates and rolls the worker, direct template and machine edits refused
	bash hack/calibrate-host.sh
	CAPK_DEV_SAMPLE=0 CAPK_DEV_NODE_IMAGE=0 bash hack/dev-up.sh
	$(CARGO) test -p capk-tests --test e2e -- --ignored --nocapture --exact cluster_class_journey_on_the_local_management_cluster

e2e-operating: ## Only the metrics/VPA scenario of make e2e: a PromQL query per metric family, the shipped alert rules in a real Prometheus, the VPA's recommendation given to the controller Pod it replaces, machine Pods untouched
	CAPK_DEV_SAMPLE=0 CAPK_DEV_NODE_IMAGE=0 CAPK_DEV_VPA=1 CAPK_DEV_MONITORING=1 bash hack/dev-up.sh
	$(CARGO) test -p capk-tests --test e2e -- --ignored --nocapture --exact operating_the_controller_on_the_local_management_cluster

e2e-workload: test-guest ## Only the real workload-cluster journey of make e2e (the node image under TCG: tens of minutes)
	bash hack/calibrate-host.sh
	CAPK_DEV_SAMPLE=0 bash hack/dev-up.sh
	$(CARGO) test -p capk-tests --test e2e -- --ignored --nocapture --exact workload_cluster_journey_on_the_local_management_cluster

e2e-move: test-guest ## clusterctl move of a running cluster to a second local management cluster (CAPK_DEV_MC=2 dev-up); its VMs keep running in the first
	bash hack/calibrate-host.sh
	CAPK_DEV_SAMPLE=0 bash hack/dev-up.sh
	CAPK_DEV_MC=2 bash hack/dev-up.sh
	$(CARGO) test -p capk-tests --test e2e -- --ignored --nocapture --exact cluster_move_between_management_clusters

bench-e2e: test-guest ## On the local MC: machine created -> guest up (test guest, P50/P95 over 10 machines), then real nodes (make bench-e2e-workload)
	bash hack/calibrate-host.sh
	CAPK_DEV_SAMPLE=0 bash hack/dev-up.sh
	$(CARGO) test -p capk-tests --test e2e -- --ignored --nocapture --test-threads=1 --exact bench_e2e_machine_boot_and_pod_overhead bench_e2e_workload_nodes

bench-dev-up: test-guest ## make dev-up as a user waits for it, to the sample's Nodes Ready: as the tree is, after make dev-down, with everything up (CAPK_BENCH_COLD=1: a clean clone from empty caches instead); after the host calibration
	bash hack/bench-dev-up.sh

bench-idle-nodes: test-guest ## Real nodes under TCG, idle: one control plane and one worker of the node-image flavor on the local MC, each machine Pod's host CPU over 60 s once every Pod is ready, and the time to both Nodes Ready (about 30 minutes)
	bash hack/calibrate-host.sh
	CAPK_DEV_SAMPLE=0 bash hack/dev-up.sh
	$(CARGO) test -p capk-tests --test e2e -- --ignored --nocapture --exact bench_idle_nodes

bench-e2e-workload: test-guest ## Real nodes under TCG: a control plane and one worker, both Nodes Ready and idle host CPU (as bench-idle-nodes), guest and Pod memory, then Machine created -> Node Ready per step (P50 over 5 workers, one at a time), kubeadm init (about 30 minutes)
	bash hack/calibrate-host.sh
	CAPK_DEV_SAMPLE=0 bash hack/dev-up.sh
	$(CARGO) test -p capk-tests --test e2e -- --ignored --nocapture --exact bench_e2e_workload_nodes

dev-down: ## Stop the local management cluster and everything it started
	bash hack/dev-down.sh

fuzz: ## Run every fuzz target (bootstrap, launcher) for a bounded time (nightly + cargo-fuzz); FUZZ_SECONDS each
	bash bootstrap/fuzz/run.sh $(FUZZ_SECONDS)

clean: ## Remove build output (keeps the Go caches outside the tree)
	$(CARGO) clean
	rm -rf $(OUTPUT)
