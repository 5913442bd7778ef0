#!/usr/bin/env bash
# Apply (or reverse) the hdet-megatron patch to the megatron.training package of the installed
# megatron-core wheel. The patch targets exactly one megatron-core release (the directory name
# under patches/); any other version is refused.
#
#   patches/apply.sh                 apply (idempotent: "already applied" is success)
#   patches/apply.sh --dry-run       only check that the action would succeed; change nothing
#   patches/apply.sh --reverse       undo (idempotent: "not applied" is success)
#   patches/apply.sh --status        print applied / not applied (exit 0 / 1), for the
#                                    megatron.training that the interpreter imports
#   patches/apply.sh --target DIR    patch DIR/megatron/training instead of the installed one
#                                    (e.g. a copy); the version is still the installed wheel's
#   patches/apply.sh --python PY     the interpreter whose megatron-core to patch
#                                    (default: $PYTHON, else python3)
#
# Exit codes: 0 ok, 1 not applied (--status), 2 usage, 3 wrong/missing megatron-core,
#             4 the files match neither the original nor the patched state (refused).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TARGET_VERSION="0.19.2"
PATCH_DIR="$HERE/megatron-core-$TARGET_VERSION"

action=apply
dry_run=0
target=""
python="${PYTHON:-python3}"

usage() { sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
die() { local code=$1; shift; echo "apply.sh: error: $*" >&2; exit "$code"; }
say() { echo "apply.sh: $*"; }

hint="(apply.sh --help lists the options)"
set_action() {  # one action per call: --reverse and --status conflict with each other
    if [[ -n "$explicit_action" && "$explicit_action" != "$2" ]]; then
        die 2 "$explicit_action conflicts with $2: give one action $hint"
    fi
    explicit_action=$2; action=$1
}
explicit_action=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run|--check) dry_run=1 ;;
        --reverse|-R) set_action reverse "$1" ;;
        --status) set_action status "$1" ;;
        --target|--python)
            [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || die 2 "$1 needs a value: $1 $([[ $1 == --target ]] && echo DIR || echo PYTHON) $hint"
            if [[ $1 == --target ]]; then target="$2"; else python="$2"; fi; shift ;;
        --target=*) target="${1#--target=}"; [[ -n "$target" ]] || die 2 "--target= needs a directory $hint" ;;
        --python=*) python="${1#--python=}"; [[ -n "$python" ]] || die 2 "--python= needs an interpreter $hint" ;;
        -h|--help) usage; exit 0 ;;
        *) die 2 "unknown argument: $1 $hint" ;;
    esac
    shift
done
if [[ $dry_run == 1 && $action == status ]]; then
    die 2 "--dry-run conflicts with --status (--status changes nothing already) $hint"
fi
if [[ -n "$target" && ! -d "$target/megatron/training" ]]; then
    [[ -d "$target" ]] || die 2 "--target $target: no such directory; give a directory holding megatron/training"
    die 2 "--target $target has no megatron/training/ inside: give the directory above megatron/ (e.g. a copy of site-packages)"
fi

command -v patch >/dev/null 2>&1 || die 3 "GNU patch is not installed (apt-get install patch)"
command -v "$python" >/dev/null 2>&1 || die 3 "python interpreter '$python' not found (use --python)"

shopt -s nullglob
patches=("$PATCH_DIR"/*.patch)
shopt -u nullglob
[[ ${#patches[@]} -gt 0 ]] || die 3 "no patches in $PATCH_DIR"

# Find the installed megatron-core distribution and its megatron/training without importing it
# (importing megatron.training needs CUDA/triton on some machines).
info="$("$python" - <<'EOF'
import importlib.metadata as md
import importlib.util
import os
try:
    dist = md.distribution("megatron-core")
except md.PackageNotFoundError:
    print("NONE")
    raise SystemExit(0)
root = os.path.abspath(str(dist.locate_file("")))
print(dist.version)
print(root)
spec = importlib.util.find_spec("megatron.training")
loc = list(spec.submodule_search_locations)[0] if spec and spec.submodule_search_locations else ""
print(os.path.abspath(loc) if loc else "")
EOF
)" || die 3 "could not query megatron-core with $python: give --python an interpreter that has megatron-core==$TARGET_VERSION"

if [[ "$info" == "NONE" ]]; then
    die 3 "megatron-core is not installed for $python; install megatron-core==$TARGET_VERSION first"
fi
version="$(sed -n 1p <<<"$info")"
dist_root="$(sed -n 2p <<<"$info")"
import_loc="$(sed -n 3p <<<"$info")"
release="${version%%+*}"
if [[ "$release" != "$TARGET_VERSION" ]]; then
    die 3 "found megatron-core $version ($dist_root) but this patch targets exactly" \
        "megatron-core==$TARGET_VERSION; refusing to patch another version." \
        "Install megatron-core==$TARGET_VERSION (pip install megatron-core==$TARGET_VERSION)."
fi

if [[ -n "$target" ]]; then
    root="$(cd "$target" && pwd)"
elif [[ "$action" == status && -n "$import_loc" ]]; then
    root="${import_loc%/megatron/training}"  # --status: the megatron.training that $python imports
else
    root="$dist_root"
    if [[ -n "$import_loc" && "$import_loc" != "$root/megatron/training" ]]; then
        say "note: 'import megatron.training' resolves to $import_loc, which shadows the" \
            "installed $root/megatron/training (patching the installed one)"
    fi
fi
[[ -f "$root/megatron/training/training.py" ]] \
    || die 3 "$root/megatron/training/training.py not found (megatron-core $version without megatron/training?)"

patch_q() {  # patch_q <patch args...>: quiet, exact (no fuzz), never interactive, no reject/backup files
    patch -p1 -f -s -F 0 --no-backup-if-mismatch -r - -d "$root" "$@" >/dev/null 2>&1
}

# State of each patch file: "applied", "original" or "conflict".
state_of() {
    local file=$1
    if patch_q --dry-run -R -i "$file"; then
        echo applied
    elif patch_q --dry-run -N -i "$file"; then
        echo original
    else
        echo conflict
    fi
}

declare -a states=()
for p in "${patches[@]}"; do
    s="$(state_of "$p")"
    states+=("$s")
    if [[ "$s" == conflict ]]; then
        die 4 "$(basename "$p") neither applies to nor reverses from $root/megatron/training:" \
            "the files were modified by something else. Reinstall megatron-core==$TARGET_VERSION" \
            "(pip install --force-reinstall --no-deps megatron-core==$TARGET_VERSION) and retry."
    fi
done

all_are() { local want=$1; for s in "${states[@]}"; do [[ "$s" == "$want" ]] || return 1; done; }

say "megatron-core $version, megatron/training at $root/megatron/training"
case "$action" in
    status)
        if all_are applied; then say "status: applied"; exit 0; fi
        if all_are original; then say "status: not applied"; exit 1; fi
        say "status: partially applied (${states[*]})"; exit 1 ;;
    apply)
        if all_are applied; then say "already applied, nothing to do"; exit 0; fi
        if [[ $dry_run == 1 ]]; then say "dry run: the patch applies cleanly"; exit 0; fi
        for i in "${!patches[@]}"; do
            [[ "${states[$i]}" == original ]] || continue
            patch -p1 -N -f -F 0 --no-backup-if-mismatch -r - -d "$root" -i "${patches[$i]}"
        done
        [[ "$(state_of "${patches[0]}")" == applied ]] || die 4 "patch did not take effect"
        say "applied $(printf '%s ' "${patches[@]##*/}")" ;;
    reverse)
        if all_are original; then say "not applied, nothing to reverse"; exit 0; fi
        if [[ $dry_run == 1 ]]; then say "dry run: the patch reverses cleanly"; exit 0; fi
        for ((i = ${#patches[@]} - 1; i >= 0; i--)); do
            [[ "${states[$i]}" == applied ]] || continue
            patch -p1 -R -f -F 0 --no-backup-if-mismatch -r - -d "$root" -i "${patches[$i]}"
        done
        say "reversed $(printf '%s ' "${patches[@]##*/}")" ;;
esac
