#!/usr/bin/env bash
# ignition-validate for the capk-bootstrap tests (every generated Ignition config is validated).
exec bash "$(dirname "${BASH_SOURCE[0]}")/../build-ignition-validate.sh"
