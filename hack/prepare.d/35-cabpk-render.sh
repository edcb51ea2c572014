#!/usr/bin/env bash
# cabpk-render: CABPK's own bootstrap data generation for the controller's manifest tests
# (controller/tests/flavors.rs renders every flavor's KubeadmConfigSpec through it).
exec bash "$(dirname "${BASH_SOURCE[0]}")/../build-cabpk-render.sh"
