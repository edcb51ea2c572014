// clusterctl-ensure runs clusterctl's own cert-manager step, and only that step, against a
// management cluster: the code `clusterctl init` calls before it installs any provider
// (sigs.k8s.io/cluster-api/cmd/clusterctl/client/cluster, CertManagerClient.EnsureInstalled).
// It creates clusterctl's test Issuer and Certificate; when that fails it installs cert-manager
// from the `cert-manager:` url/version of the given clusterctl.yaml and waits until the test
// objects are accepted. Built against the pinned Cluster API module by hack/dev/cert-manager.sh
// (`ensure` mode), so the local file:// cert-manager repository is checked the way
// `clusterctl init` reads it, without installing any provider.
//
//	clusterctl-ensure CLUSTERCTL_YAML KUBECONFIG
package main

import (
	"context"
	"fmt"
	"os"

	"sigs.k8s.io/cluster-api/cmd/clusterctl/client/cluster"
	"sigs.k8s.io/cluster-api/cmd/clusterctl/client/config"
	logf "sigs.k8s.io/cluster-api/cmd/clusterctl/log"
)

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: clusterctl-ensure CLUSTERCTL_YAML KUBECONFIG")
		os.Exit(2)
	}
	verbosity := 5
	logf.SetLogger(logf.NewLogger(logf.WithThreshold(&verbosity)))
	ctx := context.Background()
	cfg, err := config.New(ctx, os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, "clusterctl config:", err)
		os.Exit(1)
	}
	cm, err := cfg.CertManager().Get()
	if err != nil {
		fmt.Fprintln(os.Stderr, "cert-manager config:", err)
		os.Exit(1)
	}
	fmt.Printf("cert-manager config: url=%s version=%s timeout=%s\n", cm.URL(), cm.Version(), cm.Timeout())
	c := cluster.New(cluster.Kubeconfig{Path: os.Args[2]}, cfg)
	if err := c.CertManager().EnsureInstalled(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "EnsureInstalled:", err)
		os.Exit(1)
	}
	plan, err := c.CertManager().PlanUpgrade(ctx)
	if err != nil {
		fmt.Fprintln(os.Stderr, "PlanUpgrade:", err)
		os.Exit(1)
	}
	fmt.Printf("cert-manager installed: externallyManaged=%v from=%q to=%q shouldUpgrade=%v\n",
		plan.ExternallyManaged, plan.From, plan.To, plan.ShouldUpgrade)
}
