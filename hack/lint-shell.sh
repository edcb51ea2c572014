#!/usr/bin/env bash
# The shell half of `make lint`: shellcheck (settings in .shellcheckrc) over every shell script of
# the repository, tracked or new (not ignored): the *.sh files and the files whose first line runs
# sh or bash (guest scripts, hooks). Any finding fails, notes included.
set -euo pipefail
# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
require shellcheck
cd "$ROOT"

scripts=()
while IFS= read -r -d '' f; do
  [[ -f $f ]] || continue # deleted in the work tree
  if [[ $f == *.sh ]] || head -n 1 "$f" | grep -qE '^#![[:space:]]*/(usr/)?bin/(env[[:space:]]+)?(ba|da)?sh([[:space:]]|$)'; then
    scripts+=("$f")
  fi
done < <(git ls-files -z --cached --others --exclude-standard)
((${#scripts[@]} > 0)) || die "no shell scripts found under $ROOT"
shellcheck --severity=style "${scripts[@]}"
log "shellcheck: ${#scripts[@]} scripts, no findings"
