// cabpk-render turns the objects of a rendered cluster template into the bootstrap data the
// kubeadm bootstrap provider (CABPK) would store for one machine, with CABPK's own code: the
// KubeadmControlPlane controller's KubeadmConfig computation (desiredstate), kubeadm's
// configuration marshalling (pkg/types), certificates (util/secret), and the cloud-init and
// Ignition generators with Flatcar's Container Linux Config transpiler (pkg/cloudinit,
// pkg/ignition). What is not CABPK: the API server round trips (objects come from stdin), the
// join token (a fixed fake) and freshly generated certificates instead of the cluster's.
//
//	cabpk-render bootstrap --role init|join|worker --endpoint HOST:PORT < cluster.yaml
//	    prints {"format": ..., "value": ...}, like a bootstrap Secret's keys; exits non-zero on
//	    any Container Linux Config warning (CABPK only logs them) so templates stay clean.
//	cabpk-render patch-template < {"template": ..., "variables": {...}}
//	    renders a ClusterClass inline patch's valueFrom.template the way the topology
//	    controller does (Go template with sprig's hermetic functions, then YAML) and prints the
//	    value as JSON.
//
// Built by hack/build-cabpk-render.sh into _output/bin/cabpk-render for the controller's
// manifest tests.
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"text/template"

	"github.com/Masterminds/sprig/v3"
	"github.com/blang/semver/v4"
	corev1 "k8s.io/api/core/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	bootstrapv1 "sigs.k8s.io/cluster-api/api/bootstrap/kubeadm/v1beta2"
	controlplanev1 "sigs.k8s.io/cluster-api/api/controlplane/kubeadm/v1beta2"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/cluster-api/bootstrap/kubeadm/pkg/cloudinit"
	"sigs.k8s.io/cluster-api/bootstrap/kubeadm/pkg/ignition"
	kubeadmtypes "sigs.k8s.io/cluster-api/bootstrap/kubeadm/pkg/types"
	"sigs.k8s.io/cluster-api/bootstrap/kubeadm/pkg/types/upstream"
	"sigs.k8s.io/cluster-api/controlplane/kubeadm/pkg/desiredstate"
	"sigs.k8s.io/cluster-api/util/secret"
)

// A well-formed fake bootstrap token: CABPK would create a real one in the workload cluster.
const fakeToken = "abcdef.0123456789abcdef"

func main() {
	if len(os.Args) < 2 {
		fail(errors.New("usage: cabpk-render bootstrap|patch-template ..."))
	}
	var err error
	switch os.Args[1] {
	case "bootstrap":
		err = bootstrap(os.Args[2:])
	case "patch-template":
		err = patchTemplate()
	default:
		err = fmt.Errorf("unknown command %q (bootstrap, patch-template)", os.Args[1])
	}
	if err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "cabpk-render:", err)
	os.Exit(1)
}

// objects holds the documents of a rendered template that CABPK's inputs come from.
type objects struct {
	cluster *clusterv1.Cluster
	kcp     *controlplanev1.KubeadmControlPlane
	kct     *bootstrapv1.KubeadmConfigTemplate
	md      *clusterv1.MachineDeployment
}

// readObjects decodes the documents CABPK reads, strictly: a field CAPI v1beta2 does not
// know fails here as it would fail server-side validation.
func readObjects(r io.Reader) (*objects, error) {
	out := &objects{}
	docs := utilyaml.NewYAMLReader(bufio.NewReader(r))
	for {
		doc, err := docs.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, err
		}
		var meta struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
		}
		if err := yaml.Unmarshal(doc, &meta); err != nil {
			return nil, err
		}
		var target any
		switch meta.Kind {
		case "Cluster":
			out.cluster = &clusterv1.Cluster{}
			target = out.cluster
		case "KubeadmControlPlane":
			out.kcp = &controlplanev1.KubeadmControlPlane{}
			target = out.kcp
		case "KubeadmConfigTemplate":
			out.kct = &bootstrapv1.KubeadmConfigTemplate{}
			target = out.kct
		case "MachineDeployment":
			out.md = &clusterv1.MachineDeployment{}
			target = out.md
		default:
			continue
		}
		if err := yaml.UnmarshalStrict(doc, target); err != nil {
			return nil, fmt.Errorf("%s %s: %w", meta.APIVersion, meta.Kind, err)
		}
	}
	if out.cluster == nil {
		return nil, errors.New("no Cluster in the input")
	}
	return out, nil
}

func bootstrap(args []string) error {
	fs := flag.NewFlagSet("bootstrap", flag.ContinueOnError)
	role := fs.String("role", "init", "init (first control plane), join (another control plane) or worker")
	endpoint := fs.String("endpoint", "", "the Cluster's spec.controlPlaneEndpoint as HOST:PORT (the KVMCluster sets it)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	objs, err := readObjects(os.Stdin)
	if err != nil {
		return err
	}
	host, port, err := net.SplitHostPort(*endpoint)
	if err != nil {
		return fmt.Errorf("--endpoint: %w", err)
	}
	p, err := strconv.Atoi(port)
	if err != nil {
		return fmt.Errorf("--endpoint port: %w", err)
	}
	cluster := objs.cluster
	cluster.Spec.ControlPlaneEndpoint = clusterv1.APIEndpoint{Host: host, Port: int32(p)}

	var spec bootstrapv1.KubeadmConfigSpec
	var version string
	switch *role {
	case "init", "join":
		if objs.kcp == nil {
			return errors.New("no KubeadmControlPlane in the input")
		}
		// What the KubeadmControlPlane controller creates for its machines.
		cfg, err := desiredstate.ComputeDesiredKubeadmConfig(objs.kcp, cluster, *role == "join", "machine", nil)
		if err != nil {
			return err
		}
		spec, version = cfg.Spec, objs.kcp.Spec.Version
	case "worker":
		if objs.kct == nil || objs.md == nil {
			return errors.New("no KubeadmConfigTemplate and MachineDeployment in the input")
		}
		// A MachineSet copies the template's spec into each machine's KubeadmConfig.
		spec, version = *objs.kct.Spec.Template.Spec.DeepCopy(), objs.md.Spec.Template.Spec.Version
	default:
		return fmt.Errorf("--role %q: want init, join or worker", *role)
	}
	parsed, err := semver.ParseTolerant(version)
	if err != nil {
		return fmt.Errorf("kubernetes version %q: %w", version, err)
	}
	for _, f := range spec.Files {
		if f.ContentFrom.IsDefined() || f.ContentFormat != "" {
			return fmt.Errorf("file %s: contentFrom and contentFormat need the API server; not supported here", f.Path)
		}
	}
	for _, u := range spec.Users {
		if u.PasswdFrom.IsDefined() {
			return fmt.Errorf("user %s: passwdFrom needs the API server; not supported here", u.Name)
		}
	}

	base := cloudinit.BaseUserData{
		AdditionalFiles:     spec.Files,
		BootCommands:        spec.BootCommands,
		PreKubeadmCommands:  spec.PreKubeadmCommands,
		PostKubeadmCommands: spec.PostKubeadmCommands,
		Users:               spec.Users,
		Mounts:              spec.Mounts,
		KubernetesVersion:   parsed,
	}
	if spec.NTP.IsDefined() {
		base.NTP = &spec.NTP
	}
	if spec.DiskSetup.IsDefined() {
		base.DiskSetup = &spec.DiskSetup
	}
	if spec.Verbosity != nil {
		base.KubeadmVerbosity = fmt.Sprintf("--v %d", *spec.Verbosity)
	}

	var data []byte
	var warnings string
	switch *role {
	case "init":
		data, warnings, err = initControlPlane(cluster, &spec, parsed, base)
	case "join":
		data, warnings, err = joinControlPlane(cluster, &spec, parsed, base)
	default:
		data, warnings, err = joinWorker(cluster, &spec, parsed, base)
	}
	if err != nil {
		return err
	}
	if strings.TrimSpace(warnings) != "" {
		return fmt.Errorf("Container Linux Config warnings (CABPK would log and continue): %s", warnings)
	}
	format := spec.Format
	if format == "" {
		format = bootstrapv1.CloudConfig
	}
	return json.NewEncoder(os.Stdout).Encode(map[string]string{"format": string(format), "value": string(data)})
}

// The reconciler's handleClusterNotInitialized.
func initControlPlane(cluster *clusterv1.Cluster, spec *bootstrapv1.KubeadmConfigSpec, v semver.Version, base cloudinit.BaseUserData) ([]byte, string, error) {
	cc := &spec.ClusterConfiguration
	if cc.ControlPlaneEndpoint == "" {
		cc.ControlPlaneEndpoint = cluster.Spec.ControlPlaneEndpoint.String()
	}
	extra := &upstream.AdditionalData{
		ClusterName:       ptr.To(cluster.Name),
		KubernetesVersion: ptr.To("v" + v.String()),
	}
	if cluster.Spec.ClusterNetwork.ServiceDomain != "" {
		extra.DNSDomain = ptr.To(cluster.Spec.ClusterNetwork.ServiceDomain)
	}
	if len(cluster.Spec.ClusterNetwork.Services.CIDRBlocks) > 0 {
		extra.ServiceSubnet = ptr.To(cluster.Spec.ClusterNetwork.Services.String())
	}
	if len(cluster.Spec.ClusterNetwork.Pods.CIDRBlocks) > 0 {
		extra.PodSubnet = ptr.To(cluster.Spec.ClusterNetwork.Pods.String())
	}
	extra.ControlPlaneComponentHealthCheckSeconds = spec.InitConfiguration.Timeouts.ControlPlaneComponentHealthCheckSeconds
	clusterData, err := kubeadmtypes.MarshalClusterConfigurationForVersion(cc, v, extra)
	if err != nil {
		return nil, "", err
	}
	initData, err := kubeadmtypes.MarshalInitConfigurationForVersion(&spec.InitConfiguration, v)
	if err != nil {
		return nil, "", err
	}
	certificates := secret.NewCertificatesForInitialControlPlane(cc)
	if err := certificates.Generate(); err != nil {
		return nil, "", err
	}
	input := &cloudinit.ControlPlaneInput{
		BaseUserData:         base,
		InitConfiguration:    initData,
		ClusterConfiguration: clusterData,
		Certificates:         certificates,
	}
	if spec.Format == bootstrapv1.Ignition {
		return ignition.NewInitControlPlane(&ignition.ControlPlaneInput{ControlPlaneInput: input, Ignition: &spec.Ignition})
	}
	data, err := cloudinit.NewInitControlPlane(input)
	return data, "", err
}

// The reconciler's joinControlplane (with reconcileDiscovery).
func joinControlPlane(cluster *clusterv1.Cluster, spec *bootstrapv1.KubeadmConfigSpec, v semver.Version, base cloudinit.BaseUserData) ([]byte, string, error) {
	if spec.JoinConfiguration.ControlPlane == nil {
		spec.JoinConfiguration.ControlPlane = &bootstrapv1.JoinControlPlane{}
	}
	certificates := secret.NewControlPlaneJoinCerts(&spec.ClusterConfiguration)
	if err := certificates.Generate(); err != nil {
		return nil, "", err
	}
	if err := discovery(cluster, spec, certificates); err != nil {
		return nil, "", err
	}
	joinData, err := kubeadmtypes.MarshalJoinConfigurationForVersion(&spec.JoinConfiguration, v)
	if err != nil {
		return nil, "", err
	}
	input := &cloudinit.ControlPlaneJoinInput{BaseUserData: base, JoinConfiguration: joinData, Certificates: certificates}
	if spec.Format == bootstrapv1.Ignition {
		return ignition.NewJoinControlPlane(&ignition.ControlPlaneJoinInput{ControlPlaneJoinInput: input, Ignition: &spec.Ignition})
	}
	data, err := cloudinit.NewJoinControlPlane(input)
	return data, "", err
}

// The reconciler's joinWorker (with reconcileDiscovery and the uninitialized taint).
func joinWorker(cluster *clusterv1.Cluster, spec *bootstrapv1.KubeadmConfigSpec, v semver.Version, base cloudinit.BaseUserData) ([]byte, string, error) {
	if spec.JoinConfiguration.ControlPlane != nil {
		return nil, "", errors.New("Machine is a Worker, but JoinConfiguration.ControlPlane is set in the KubeadmConfig object")
	}
	certificates := secret.NewCertificatesForWorker(spec.JoinConfiguration.CACertPath)
	if err := certificates.Generate(); err != nil {
		return nil, "", err
	}
	if err := discovery(cluster, spec, certificates); err != nil {
		return nil, "", err
	}
	join := spec.JoinConfiguration.DeepCopy()
	taints := append(ptr.Deref(join.NodeRegistration.Taints, []corev1.Taint{}), clusterv1.NodeUninitializedTaint)
	join.NodeRegistration.Taints = &taints
	joinData, err := kubeadmtypes.MarshalJoinConfigurationForVersion(join, v)
	if err != nil {
		return nil, "", err
	}
	input := &cloudinit.NodeInput{BaseUserData: base, JoinConfiguration: joinData}
	if spec.Format == bootstrapv1.Ignition {
		return ignition.NewNode(&ignition.NodeInput{NodeInput: input, Ignition: &spec.Ignition})
	}
	data, err := cloudinit.NewNode(input)
	return data, "", err
}

func discovery(cluster *clusterv1.Cluster, spec *bootstrapv1.KubeadmConfigSpec, certificates secret.Certificates) error {
	bt := &spec.JoinConfiguration.Discovery.BootstrapToken
	if len(bt.CACertHashes) == 0 {
		hashes, err := certificates.GetByPurpose(secret.ClusterCA).Hashes()
		if err != nil {
			return err
		}
		bt.CACertHashes = hashes
	}
	if bt.APIServerEndpoint == "" {
		bt.APIServerEndpoint = cluster.Spec.ControlPlaneEndpoint.String()
	}
	if bt.Token == "" {
		bt.Token = fakeToken
	}
	return nil
}

// The topology controller's renderValueTemplate (core/reconcilers/topology/cluster/patches/inline).
func patchTemplate() error {
	var in struct {
		Template  string         `json:"template"`
		Variables map[string]any `json:"variables"`
	}
	if err := json.NewDecoder(os.Stdin).Decode(&in); err != nil {
		return err
	}
	tpl, err := template.New("tpl").Funcs(sprig.HermeticTxtFuncMap()).Parse(in.Template)
	if err != nil {
		return err
	}
	var buf bytes.Buffer
	if err := tpl.Execute(&buf, in.Variables); err != nil {
		return err
	}
	value := apiextensionsv1.JSON{}
	if err := yaml.Unmarshal(buf.Bytes(), &value); err != nil {
		return fmt.Errorf("the rendered template is not YAML: %w", err)
	}
	_, err = os.Stdout.Write(append(value.Raw, '\n'))
	return err
}
