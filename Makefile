# cluster-api-provider-kvm
SHELL := /usr/bin/env bash
CARGO ?= cargo
OUTPUT := _output

.PHONY: all build check check-no-local-mc packages test test-deps lint fmt generate release-manifests bench calibrate test-guest bench-controller bench-launcher bench-e2e bench-e2e-workload bench-idle-node bench-idle-nodes bench-dev-up testenv testenv-down dev-up dev-down e2e e2e-stub e2e-topology e2e-operating e2e-workload fuzz clean help node-image test-node-image

all: build

# $(call journey,DEV_UP_ENV,TESTS[,TEST_FLAGS]): a journey on the local management cluster: the
# host's calibration, make dev-up as DEV_UP_ENV says, then the named ignored tests of tests/e2e.
STUB_JOURNEYS := cluster_journey_on_the_local_management_cluster cluster_class_journey_on_the_local_management_cluster
OPERATING_JOURNEY := operating_the_controller_on_the_local_management_cluster
WORKLOAD_JOURNEY := workload_cluster_journey_on_the_local_management_cluster

define journey
bash hack/calibrate-host.sh
$(1) bash hack/dev-up.sh
$(CARGO) test -p capk-tests --test e2e -- --ignored --nocapture $(3) --exact $(2)
endef

help: ## Show the targets
	@grep -hE '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

build: ## Build every crate
	$(CARGO) build --workspace --all-targets

# Build/prepare what the tests need (upstream binaries, test guest); skips what exists
test-deps: ## Build what the tests need (upstream binaries, test guest); skips what exists
	bash hack/prepare-test-deps.sh

test: test-deps ## Run every test (unit, integration against a real kube-apiserver, launcher)
	$(CARGO) test --workspace --no-fail-fast

# What CI runs after installing packages (.ci/run): make lint, make test, then make e2e-stub on a
# local MC that is torn down afterwards, pass or fail (hack/e2e-gate.sh; root, no local MC running)
check: packages check-no-local-mc lint test ## What CI runs: lint, test, then the stub journey on a local MC torn down afterwards
	bash hack/e2e-gate.sh

# The Debian packages a fresh machine lacks (root), and a check of the Go and Rust toolchains
packages: ## Install the Debian packages a fresh machine lacks; check the Go and Rust toolchains
	@bash hack/install-packages.sh

check-no-local-mc: # make check's journey needs the machine's one local MC: say at once when one runs
	@bash hack/e2e-gate.sh --precheck

# cargo fmt --check, clippy with warnings denied, shellcheck over every shell script
lint: ## cargo fmt --check, clippy with warnings denied, shellcheck
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	bash hack/lint-shell.sh

fmt: ## Format the code
	$(CARGO) fmt --all

generate: ## Regenerate manifests/crd from the Rust types
	$(CARGO) run -q -p capk-api --example crdgen -- manifests/crd

bench: bench-controller bench-launcher bench-e2e ## Every benchmark

# The host's TCG speed: the test guest's boot and fixed workload timed against the reference
# machine (docs/benchmarks.md), one line and _output/calibration.env; every emulation benchmark
# runs it first
calibrate: test-guest ## The host's TCG speed against the reference machine (every emulation benchmark runs it)
	bash hack/calibrate-host.sh

# Only the launcher's test guest of make test-deps (images/test-guest), into _output/test-guest;
# skipped when up to date
test-guest: ## Only the launcher's test guest (images/test-guest), into _output/test-guest
	bash hack/prepare.d/40-test-guest.sh

bench-launcher: test-deps ## Launcher start-up, guest boot and RSS under QEMU (root, netns)
	bash hack/calibrate-host.sh
	$(CARGO) test -p capk-launcher --release --test vm_netns -- --ignored --nocapture bench

bench-controller: test-deps ## N KVMMachines (CAPK_BENCH_MACHINES, default 1000) against a real apiserver
	$(CARGO) bench -p capk-controller --bench controller

# clusterctl repository files under _output/release/infrastructure-kvm/<version>
release-manifests: test-deps ## clusterctl repository files under _output/release/infrastructure-kvm/<version>
	@bash hack/release-manifests.sh

# Start etcd + kube-apiserver with our CRDs in the background; last line = kubeconfig
testenv: test-deps ## etcd + kube-apiserver with our CRDs in the background; last line = kubeconfig
	@bash hack/testenv.sh up

testenv-down: ## Stop the environment started by `make testenv`
	@bash hack/testenv.sh down

# Kubernetes node image (images/node): _output/node-image/node.qcow2 and
# localhost/capk/node:<version>-<hash>
node-image: ## The Kubernetes node image (images/node) into _output/node-image
	bash images/node/build.sh

# Boot the node image under QEMU: Ignition, preloaded images, kubeadm init with no registry
test-node-image: node-image ## Boot the node image under QEMU: Ignition, preloaded images, kubeadm init
	$(CARGO) test -p capk-launcher --test node_image -- --ignored --nocapture --skip bench_

# An idle control plane of the node-image flavor under TCG, watched from the host: time to every
# Pod ready, QEMU's host CPU over 60 s, the guest's split, apiserver requests/s (flavor variables
# from the environment; CAPK_BENCH_PERF=1 samples QEMU, CAPK_BENCH_PPROF=1 profiles the apiserver
# and kubelet into _output/bench/)
bench-idle-node: node-image test-guest ## An idle control plane of the node-image flavor under TCG, watched from the host
	bash hack/calibrate-host.sh
	$(CARGO) test -p capk-launcher --test node_image -- --ignored --nocapture --exact bench_idle_control_plane

# The local management cluster with Cluster API and CAPK (clusterctl init) and a sample workload
# cluster of the node image, two Nodes Ready (CAPK_DEV_SAMPLE=stub: the stand-in test guest; =0:
# none)
dev-up: ## The local management cluster, CAPK installed, and a sample workload cluster (2 Nodes)
	bash hack/dev-up.sh

# End to end on the local management cluster (make dev-up without the sample, with the VPA and
# Prometheus): the stub-guest journey (create, scale, upgrade, faults, pause, delete), the
# ClusterClass scenario (NodePort from the host, a variable rotates a template), the controller's
# metrics in Prometheus and the controller under the VPA, then a real workload cluster of the node
# image (Nodes Ready, CNI, DNS, host volume, delete)
e2e: test-guest ## Every journey on the local MC: stub guests, ClusterClass, operating, a real workload cluster
	$(call journey,CAPK_DEV_SAMPLE=0 CAPK_DEV_VPA=1 CAPK_DEV_MONITORING=1,$(STUB_JOURNEYS) $(OPERATING_JOURNEY) $(WORKLOAD_JOURNEY))

# The stub-guest scenarios of make e2e: the journey and the ClusterClass scenario (the local MC
# without the sample cluster and the node image, which they do not use)
e2e-stub: test-guest ## make e2e's stub-guest journeys: the cluster journey and the ClusterClass scenario
	$(call journey,CAPK_DEV_SAMPLE=0 CAPK_DEV_NODE_IMAGE=0,$(STUB_JOURNEYS))

# Only the ClusterClass scenario of make e2e-stub (stub guests): a Cluster of the class kvm with a
# NodePort control plane reached from the host through its kubeconfig, a changed variable that
# rotates the KVMMachineTemplates and rolls the worker, direct template and machine edits refused
e2e-topology: test-guest ## Only make e2e's ClusterClass scenario (stub guests)
	$(call journey,CAPK_DEV_SAMPLE=0 CAPK_DEV_NODE_IMAGE=0,cluster_class_journey_on_the_local_management_cluster)

# Only the metrics/VPA scenario of make e2e: a PromQL query per metric family, the shipped alert
# rules in a real Prometheus, the VPA's recommendation given to the controller Pod it replaces,
# machine Pods untouched
e2e-operating: test-guest ## Only make e2e's metrics, alerts and VPA scenario
	$(call journey,CAPK_DEV_SAMPLE=0 CAPK_DEV_NODE_IMAGE=0 CAPK_DEV_VPA=1 CAPK_DEV_MONITORING=1,$(OPERATING_JOURNEY))

# Only the real workload-cluster journey of make e2e (the node image under TCG: tens of minutes)
e2e-workload: test-guest ## Only make e2e's real workload-cluster journey (the node image under TCG)
	$(call journey,CAPK_DEV_SAMPLE=0,$(WORKLOAD_JOURNEY))

# clusterctl move of a running cluster to a second local management cluster (CAPK_DEV_MC=2 dev-up);
# its VMs keep running in the first
e2e-move: test-guest ## clusterctl move of a running cluster to a second local management cluster
	bash hack/calibrate-host.sh
	CAPK_DEV_SAMPLE=0 bash hack/dev-up.sh
	CAPK_DEV_MC=2 bash hack/dev-up.sh
	$(CARGO) test -p capk-tests --test e2e -- --ignored --nocapture --exact cluster_move_between_management_clusters

# On the local MC: machine created -> guest up (test guest, P50/P95 over 10 machines), then real
# nodes (make bench-e2e-workload)
bench-e2e: test-guest ## Machine created -> guest up (test guest, P50/P95), then bench-e2e-workload
	$(call journey,CAPK_DEV_SAMPLE=0,bench_e2e_machine_boot_and_pod_overhead bench_e2e_workload_nodes,--test-threads=1)

# make dev-up as a user waits for it, to the sample's Nodes Ready: as the tree is, after make
# dev-down, with everything up (CAPK_BENCH_COLD=1: a clean clone from empty caches instead); after
# the host calibration
bench-dev-up: test-guest ## How long make dev-up takes: as the tree is, after make dev-down, with everything up
	bash hack/bench-dev-up.sh

# Real nodes under TCG, idle: one control plane and one worker of the node-image flavor on the
# local MC, each machine Pod's host CPU over 60 s once every Pod is ready, and the time to both
# Nodes Ready (about 30 minutes)
bench-idle-nodes: test-guest ## Two real idle nodes under TCG: host CPU per machine Pod, time to Nodes Ready
	$(call journey,CAPK_DEV_SAMPLE=0,bench_idle_nodes)

# Real nodes under TCG: a control plane and one worker, both Nodes Ready and idle host CPU (as
# bench-idle-nodes), guest and Pod memory, then Machine created -> Node Ready per step (P50 over 5
# workers, one at a time), kubeadm init (about 30 minutes)
bench-e2e-workload: test-guest ## Real nodes under TCG: Nodes Ready, idle CPU, memory, Machine -> Node Ready
	$(call journey,CAPK_DEV_SAMPLE=0,bench_e2e_workload_nodes)

dev-down: ## Stop the local management cluster and everything it started
	bash hack/dev-down.sh

# Run every fuzz target (bootstrap, launcher) for a bounded time (nightly + cargo-fuzz);
# FUZZ_SECONDS each
fuzz: ## Every fuzz target for a bounded time (nightly + cargo-fuzz); FUZZ_SECONDS each
	bash bootstrap/fuzz/run.sh $(FUZZ_SECONDS)

clean: ## Remove build output (keeps the Go caches outside the tree)
	$(CARGO) clean
	rm -rf $(OUTPUT)
