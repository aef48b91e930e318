#!/usr/bin/env bash
# Fault script of issue 26: the README's finetune example (`init-model` with the README's
# arguments, then `--config examples/finetune.toml finetune`) run under faults, and after
# each: the exit code, the message, no stray files (swap directories, temporaries), and
# every checkpoint and export either complete and verified or absent.
#
#   .ci/fault-finetune.sh [ROUNDS]     (ROUNDS of kill -9 at random moments, default 5)
#
# Scenarios: kill -9 at random moments (each followed by a --resume that must finish the
# run); Ctrl-C (SIGINT) and SIGTERM; read-only checkpoint and export directories; a full
# disk under the checkpoints and under the swap directory (a small tmpfs: needs mount
# rights, else SKIP with the reason); NaN weights; huge weights (a diverged first step).
# Prints one table row per scenario and exits 1 if any row FAILs. Uses
# target/release/tidestore (built if missing) and python3 (to verify safetensors files).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
ROUNDS=${1:-5}
# TIDESTORE_BIN: another build to run (e.g. an older one, to see what it fails).
BIN=${TIDESTORE_BIN:-$ROOT/target/release/tidestore}
if [ ! -x "$BIN" ]; then
    cargo build --release --bin tidestore >&2 || exit 1
fi
command -v python3 >/dev/null || { echo "SKIP: python3 is needed to verify files"; exit 0; }

W=$(mktemp -d /tmp/tidestore-fault.XXXXXX)
MOUNTS=()
cleanup() {
    for m in "${MOUNTS[@]}"; do umount "$m" 2>/dev/null; done
    rm -rf "$W"
}
trap cleanup EXIT
ROWS=()
FAILS=0
row() { # scenario, exit, message, stray, files, verdict
    ROWS+=("$(printf '| %-34s | %-5s | %-7s | %-7s | %-28s | %-4s |' "$1" "$2" "$3" "$4" "$5" "$6")")
    [ "$6" = FAIL ] && FAILS=$((FAILS + 1))
}

# The example's layout: examples/ (config and text) beside models/ and runs/.
mkdir -p "$W/examples/data" "$W/.tidestore-swap"
cp examples/finetune.toml "$W/examples/"
cp examples/data/genesis-kjv.txt "$W/examples/data/"
cd "$W"
"$BIN" init-model --out models/tiny-llama --layers 4 --hidden 256 \
    --intermediate 704 --heads 8 --kv-heads 4 --vocab 512 >/dev/null 2>&1 || {
    echo "init-model failed"; exit 1; }
# Checkpoints every 2 steps, so that faults land between and during them.
sed -i 's/^checkpoint_every = .*/checkpoint_every = 2/' examples/finetune.toml
CFG=examples/finetune.toml
CK=runs/tiny-llama/checkpoints
EX=runs/tiny-llama/export
SWAP=.tidestore-swap

# Verifies every safetensors file under $1 (header parses, offsets contiguous and
# covering the file); prints "ok N" or the first problem.
verify_dir() {
    python3 - "$1" <<'EOF'
import json, os, struct, sys
d = sys.argv[1]
n = 0
if os.path.isdir(d):
    for f in sorted(os.listdir(d)):
        if not f.endswith(".safetensors"):
            continue
        b = open(os.path.join(d, f), "rb").read()
        h = struct.unpack("<Q", b[:8])[0]
        meta = json.loads(b[8:8 + h])
        spans = sorted(v["data_offsets"] for k, v in meta.items() if k != "__metadata__")
        end = 0
        for a, z in spans:
            if a != end:
                print(f"{f}: gap at {a}"); sys.exit(0)
            end = z
        if 8 + h + end != len(b):
            print(f"{f}: {len(b)} bytes, header says {8 + h + end}"); sys.exit(0)
        n += 1
print(f"ok {n}")
EOF
}

# Stray files: swap directories, temporaries of checkpoints and exports, probes.
strays() {
    { ls -A "$SWAP" 2>/dev/null
      ls -A "$CK" 2>/dev/null | grep -v '^ckpt-[0-9]*\.safetensors$'
      ls -A runs/tiny-llama 2>/dev/null | grep -v '^checkpoints$\|^export$'
      ls -A "$W" | grep '^\.tidestore-probe'; } | tr '\n' ' '
}

# An export is verified by fine-tuning it for one step: the import checks every tensor
# (shapes, dtypes, finite values) against its config.json.
verify_export() {
    [ -d "$EX" ] || { echo absent; return; }
    sed -e "s#^model_dir = .*#model_dir = \"../$EX\"#" -e '/^checkpoint_/d' -e '/^export_dir/d' \
        $CFG > examples/verify.toml
    if "$BIN" --config examples/verify.toml finetune --steps 1 >/dev/null 2>"$W/verify.err"; then
        echo verified
    else
        echo "BAD: $(tail -1 "$W/verify.err")"
    fi
    rm -f examples/verify.toml
}

fresh() { rm -rf runs "$SWAP"; mkdir -p "$SWAP"; }

# ---- kill -9 at random moments, then --resume --------------------------------------------
STEPS=10
for r in $(seq 1 "$ROUNDS"); do
    fresh
    "$BIN" --config $CFG finetune --steps $STEPS >/dev/null 2>"$W/err" &
    pid=$!
    delay=$(python3 -c "import random; print(round(random.uniform(0.5, 12), 2))")
    sleep "$delay"
    kill -9 $pid 2>/dev/null
    wait $pid; code=$?
    ck=$(verify_dir $CK)
    left=$(strays | wc -w)
    # The next run removes what the killed one left, verifies the newest checkpoint and
    # finishes the run.
    if "$BIN" --config $CFG finetune --steps $STEPS --resume >/dev/null 2>"$W/err2"; then
        resumed=ok
    else
        resumed="BAD: $(tail -1 "$W/err2")"
    fi
    ck2=$(verify_dir $CK); ex=$(verify_export); s=$(strays)
    verdict=PASS
    case "$ck $ck2" in *ok*ok*) ;; *) verdict=FAIL ;; esac
    [ "$resumed" = ok ] && [ "$ex" = verified ] && [ -z "$s" ] || verdict=FAIL
    row "kill -9 at ${delay}s ($left left), resume" "$code" "-" "${s:-none}" "ckpt $ck/$ck2, export $ex" $verdict
    [ "$verdict" = FAIL ] && echo "kill -9 round $r: resume=$resumed ck=$ck ck2=$ck2 ex=$ex strays=$s" >&2
done

# ---- kill -9 during the export ------------------------------------------------------------
fresh
"$BIN" --config $CFG finetune --steps 2 >/dev/null 2>"$W/err" &
pid=$!
seen=no
while kill -0 $pid 2>/dev/null; do
    if ls -d runs/tiny-llama/.export.tmp.* >/dev/null 2>&1; then
        kill -9 $pid; seen=yes; break
    fi
    sleep 0.005
done
wait $pid; code=$?
left=$(ls -A runs/tiny-llama 2>/dev/null | grep -c '^\.export\.tmp\.')
"$BIN" --config $CFG finetune --steps 2 --resume >/dev/null 2>"$W/err2"; code2=$?
ex=$(verify_export); s=$(strays)
verdict=PASS
[ "$code2" = 0 ] && [ "$ex" = verified ] && [ -z "$s" ] || verdict=FAIL
[ "$seen" = no ] && verdict=SKIP && echo "SKIP kill -9 during export: the export ended before it was seen" >&2
row "kill -9 in export ($left tmp left), resume" "$code" "-" "${s:-none}" "export $ex" $verdict

# ---- Ctrl-C and SIGTERM after the first checkpoint ---------------------------------------
for sig in INT TERM; do
    fresh
    # As from a terminal: a background job of this shell would ignore SIGINT.
    python3 -c 'import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
os.execv(sys.argv[1], sys.argv[1:])' "$BIN" --config $CFG finetune --steps 200 >/dev/null 2>"$W/err" &
    pid=$!
    for _ in $(seq 1 600); do [ -e $CK/ckpt-000002.safetensors ] && break; sleep 0.1; done
    kill -$sig $pid
    wait $pid; code=$?
    want=$([ $sig = INT ] && echo 130 || echo 143)
    msg=$(grep -c "interrupted by SIG$sig" "$W/err")
    ck=$(verify_dir $CK); s=$(strays)
    verdict=PASS
    [ "$code" = "$want" ] && [ "$msg" = 1 ] && [ -z "$s" ] && [ "${ck#ok }" != 0 ] \
        && [ "${ck%% *}" = ok ] && [ ! -e $EX ] || verdict=FAIL
    echo "SIG$sig: $(grep interrupted "$W/err")" >&2
    row "SIG$sig after the first checkpoint" "$code" "$([ "$msg" = 1 ] && echo ok || echo BAD)" "${s:-none}" "ckpt $ck, export absent" $verdict
done

# ---- read-only outputs ----------------------------------------------------------------------
ro_dir() { # a read-only directory at $1 (a read-only tmpfs as root, chmod otherwise)
    mkdir -p "$1"
    if [ "$(id -u)" = 0 ]; then
        mount -t tmpfs -o ro,size=1m tmpfs "$1" 2>/dev/null && { MOUNTS+=("$1"); return 0; }
        return 1
    fi
    chmod 555 "$1"
}
for what in checkpoint_dir export_dir; do
    fresh
    if ! ro_dir "$W/ro-$what"; then
        row "read-only train.$what" "-" "-" "-" "-" SKIP
        echo "SKIP read-only $what: cannot mount a read-only tmpfs" >&2
        continue
    fi
    target="../ro-$what/out"
    [ $what = checkpoint_dir ] && target="../ro-$what"
    sed "s#^$what = .*#$what = \"$target\"#" $CFG > examples/ro.toml
    "$BIN" --config examples/ro.toml finetune --steps 4 >"$W/out" 2>"$W/err"; code=$?
    msg=$(grep -c "train.$what" "$W/err")
    s=$(strays)
    verdict=PASS
    [ "$code" = 2 ] && [ "$msg" = 1 ] && [ ! -s "$W/out" ] && [ -z "$s" ] || verdict=FAIL
    echo "read-only $what: $(tail -1 "$W/err")" >&2
    row "read-only train.$what" "$code" "$([ "$msg" = 1 ] && echo ok || echo BAD)" "${s:-none}" "no step run: $([ -s "$W/out" ] && echo no || echo yes)" $verdict
    rm -f examples/ro.toml
done

# ---- a full disk ------------------------------------------------------------------------------
full_disk() { # name, key, size, config line
    fresh
    local dir="$W/full-$1"
    mkdir -p "$dir"
    if ! mount -t tmpfs -o "size=$3" tmpfs "$dir" 2>/dev/null; then
        row "full disk under $2" "-" "-" "-" "-" SKIP
        echo "SKIP full disk ($2): cannot mount a tmpfs (needs CAP_SYS_ADMIN)" >&2
        return
    fi
    MOUNTS+=("$dir")
    sed "s#^$2 = .*#$2 = \"$4\"#" $CFG > examples/full.toml
    "$BIN" --config examples/full.toml finetune --steps 8 >/dev/null 2>"$W/err"; code=$?
    msg=$(grep -ci "no space left\|ENOSPC\|nvme.size\|full" "$W/err")
    ck=$(verify_dir "$dir"); s=$(strays)
    extra=$(ls -A "$dir" | grep -v '^ckpt-[0-9]*\.safetensors$' | tr '\n' ' ')
    verdict=PASS
    [ "$code" != 0 ] && [ "$msg" -ge 1 ] && [ -z "$s$extra" ] && [ "${ck%% *}" = ok ] || verdict=FAIL
    echo "full disk under $2: $(tail -1 "$W/err")" >&2
    s="$s$extra"
    row "full disk ($3) under $2" "$code" "$([ "$msg" -ge 1 ] && echo ok || echo BAD)" "${s:-none}" "ckpt $ck" $verdict
    rm -f examples/full.toml
}
# A checkpoint of this model is about 45 MB: the first fits, the second does not.
full_disk ckpt checkpoint_dir 60m "../full-ckpt"
full_disk swap dir 4m "../full-swap"

# ---- NaN and huge weights --------------------------------------------------------------------
patch() { # tensor, bf16 bits, count: overwrites the first COUNT elements of TENSOR
    python3 - models/tiny-llama "$1" "$2" "$3" <<'EOF'
import json, os, struct, sys
d, name, bits, count = sys.argv[1], sys.argv[2], int(sys.argv[3], 16), int(sys.argv[4])
idx = os.path.join(d, "model.safetensors.index.json")
f = json.load(open(idx))["weight_map"][name] if os.path.exists(idx) else "model.safetensors"
p = os.path.join(d, f)
b = bytearray(open(p, "rb").read())
h = struct.unpack("<Q", b[:8])[0]
t = json.loads(b[8:8 + h])[name]
assert t["dtype"] == "BF16", t
s = 8 + h + t["data_offsets"][0]
for i in range(count):
    b[s + 2 * i:s + 2 * i + 2] = struct.pack("<H", bits)
open(p, "wb").write(b)
EOF
}
cp -a models/tiny-llama models/pristine
for case in "model.layers.1.mlp.up_proj.weight 7fc0 5 NaN weights" \
            "model.norm.weight 7f7f 256 huge weights (diverges)"; do
    set -- $case
    fresh
    rm -rf models/tiny-llama; cp -a models/pristine models/tiny-llama
    patch "$1" "$2" "$3"
    "$BIN" --config $CFG finetune --steps 4 >/dev/null 2>"$W/err"; code=$?
    if [ "$4" = NaN ]; then
        msg=$(grep -c "$1.*index 0" "$W/err")
    else
        msg=$(grep -c "step 1: loss .*no loss scaler" "$W/err")
    fi
    s=$(strays)
    verdict=PASS
    [ "$code" = 1 ] && [ "$msg" = 1 ] && [ ! -e $EX ] && [ -z "$s" ] || verdict=FAIL
    row "${*:4}" "$code" "$([ "$msg" = 1 ] && echo ok || echo BAD)" "${s:-none}" "export $([ -e $EX ] && echo PRESENT || echo absent)" $verdict
    echo "${*:4}: $(tail -1 "$W/err")" >&2
done

echo
echo "| scenario                           | exit  | message | strays  | checkpoints / export         | verdict |"
echo "|------------------------------------|-------|---------|---------|------------------------------|------|"
printf '%s\n' "${ROWS[@]}"
[ "$FAILS" = 0 ]
