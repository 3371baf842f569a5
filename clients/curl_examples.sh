#!/usr/bin/env bash
# The verl Ray tutorial, step by step, over HTTP with curl.
#
#   serve run serve_config.yaml          # in another terminal; wait for /readyz to say ready
#   bash clients/curl_examples.sh        # URL=http://host:8000 and SC_AUTH_TOKEN=... if needed
#
# Run on a fresh service: the accumulators keep state, so the expected outputs below hold
# for the first run only. Every answer is JSON; errors are {"error": "..."} with a 4xx/5xx
# status. Tensors in JSON are Open Inference Protocol tensor objects:
#   {"datatype": "FP32", "shape": [1], "data": [1.0]}
# The MLP steps build their bodies with python3 (standard library only).
set -euo pipefail

URL="${URL:-http://127.0.0.1:8000}"
AUTH=()
if [[ -n "${SC_AUTH_TOKEN:-}" ]]; then
    AUTH=(-H "Authorization: Bearer ${SC_AUTH_TOKEN}")
fi
JSON=(-H "Content-Type: application/json")
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

step() { printf '\n== %s\n' "$*"; }

# ---------------------------------------------------------------------------------------
step "Health (no token needed)"
curl -sS "$URL/healthz"; echo
# {"status":"live","groups":{}}
curl -sS "$URL/readyz"; echo
# {"status":"ready","groups":{"accumulator":true,"gpu_accumulator":true,...}}
# (503 {"error":"not ready: ..."} while groups start)

step "Groups"
curl -sS "${AUTH[@]}" "$URL/v1/groups"; echo
# {"groups":[{"name":"accumulator","world_size":1,...},{"name":"gpu_accumulator","world_size":4,...},
#            {"name":"gpu_accumulator_a","world_size":4,...},{"name":"gpu_accumulator_merge","world_size":8,...},...]}
curl -sS "${AUTH[@]}" "$URL/v1/groups/gpu_accumulator_merge"; echo
# {"name":"gpu_accumulator_merge","world_size":8,...,"ranks":[{"rank":0,"local_rank":0,...},...]}

# ---------------------------------------------------------------------------------------
step "Chapter 1: Accumulator (a plain actor)"
curl -sS "${AUTH[@]}" "${JSON[@]}" -X POST "$URL/v1/groups/accumulator/get_value" -d '{}'; echo
# {"group":"accumulator","method":"get_value",...,"output":0}
curl -sS "${AUTH[@]}" "${JSON[@]}" -X POST "$URL/v1/groups/accumulator/add" -d '{"args": [10]}'; echo
# {...,"output":null}
curl -sS "${AUTH[@]}" "${JSON[@]}" -X POST "$URL/v1/groups/accumulator/get_value" -d '{}'; echo
# {...,"output":10}

# ---------------------------------------------------------------------------------------
step "Chapter 2: RayWorkerGroup of GPUAccumulator on pool [4] (execute_all: one x per rank)"
curl -sS "${AUTH[@]}" "${JSON[@]}" -X POST "$URL/v1/groups/gpu_accumulator/add" \
    -d '{"kwargs": {"x": [1, 1, 1, 1]}}'; echo
# {"group":"gpu_accumulator","method":"add","dispatch_mode":"EXECUTE_ALL",...,"world_size":4,
#  "output":[{"datatype":"FP32","shape":[1],"data":[1.0]},{..."data":[2.0]},{..."data":[3.0]},{..."data":[4.0]}]}

step "Chapter 2: the same with safetensors both ways (list items travel as x.0 .. x.3)"
python3 - "$TMP/x.safetensors" <<'PY'
import json, struct, sys
# safetensors by hand: 8-byte little-endian header length, JSON header, raw little-endian data
names = [f"x.{i}" for i in range(4)]
header = {n: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i, n in enumerate(names)}
raw = json.dumps(header).encode()
raw += b" " * (-len(raw) % 8)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw + struct.pack("<4f", 0.0, 0.0, 0.0, 0.0))
PY
curl -sS "${AUTH[@]}" -X POST "$URL/v1/groups/gpu_accumulator/get_value" \
    -H "Content-Type: application/json" -H "Accept: application/x-safetensors" -d '{}' \
    -o "$TMP/values.safetensors"
python3 - "$TMP/values.safetensors" <<'PY'
import json, struct, sys
body = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", body[:8])[0]
header = json.loads(body[8:8 + n])
for name in sorted(k for k in header if k != "__metadata__"):
    start, end = header[name]["data_offsets"]
    print(name, struct.unpack("<f", body[8 + n + start:8 + n + end]))
PY
# output.0 (1.0,)  output.1 (2.0,)  output.2 (3.0,)  output.3 (4.0,)   (get_value: unchanged)
curl -sS "${AUTH[@]}" -X POST "$URL/v1/groups/gpu_accumulator/add" \
    -H "Content-Type: application/x-safetensors" -H "Accept: application/json" \
    --data-binary @"$TMP/x.safetensors"; echo
# adds 0 to each rank: {...,"output":[{..."data":[1.0]},{..."data":[2.0]},{..."data":[3.0]},{..."data":[4.0]}]}

step "Chapter 2: GPU sharing - pool 'a' [4] and the merged pool [4, 4]"
curl -sS "${AUTH[@]}" "${JSON[@]}" -X POST "$URL/v1/groups/gpu_accumulator_a/add" \
    -d '{"kwargs": {"x": [2, 2, 2, 2]}}'; echo
# {...,"world_size":4,"output":[{..."data":[2.0]},{..."data":[3.0]},{..."data":[4.0]},{..."data":[5.0]}]}
curl -sS "${AUTH[@]}" "${JSON[@]}" -X POST "$URL/v1/groups/gpu_accumulator_merge/add" \
    -d '{"kwargs": {"x": [3, 3, 3, 3, 3, 3, 3, 3]}}'; echo
# {...,"world_size":8,"output":[{..."data":[3.0]},{..."data":[4.0]}, ... ,{..."data":[10.0]}]}   (3..10)

# ---------------------------------------------------------------------------------------
step "Chapter 3: @register(Dispatch.ONE_TO_ALL) - one x reaches every rank"
curl -sS "${AUTH[@]}" "${JSON[@]}" -X POST "$URL/v1/groups/gpu_accumulator_decorator/add" \
    -d '{"kwargs": {"x": 10}}'; echo
# {...,"dispatch_mode":"ONE_TO_ALL","world_size":8,"output":[{..."data":[10.0]},{..."data":[11.0]}, ... ,{..."data":[17.0]}]}

step "Chapter 3: custom dispatch and rank-zero execution on TestActor(x=2)"
curl -sS "${AUTH[@]}" "${JSON[@]}" -X POST "$URL/v1/groups/test_actor/foo_custom" \
    -d '{"kwargs": {"x": [1, 2], "y": [5, 6]}}'; echo
# {...,"dispatch_mode":"custom:...","output":[8,10,8,10]}
curl -sS "${AUTH[@]}" "${JSON[@]}" -X POST "$URL/v1/groups/test_actor/foo_rank_zero" \
    -d '{"kwargs": {"x": 1, "y": 2}}'; echo
# {...,"dispatch_mode":"ALL_TO_ALL","execute_mode":"RANK_ZERO","output":5}
curl -sS "${AUTH[@]}" "${JSON[@]}" -X POST "$URL/v1/groups/test_actor/foo" \
    -d '{"kwargs": {"y": 3}}'; echo
# {...,"dispatch_mode":"EXECUTE_ALL","output":[5,5,5,5]}

# ---------------------------------------------------------------------------------------
step "Chapter 4: MegatronRayWorkerGroup, tp=4 Llama MLP"
curl -sS "${AUTH[@]}" "$URL/v1/groups/mlp"; echo
# {"name":"mlp","world_size":4,...,"tp_size":4,"dp_size":1,"pp_size":1,"ranks":[{"rank":0,"tp_rank":0,...},...]}
curl -sS "${AUTH[@]}" "${JSON[@]}" -X POST "$URL/v1/groups/mlp/init_model" \
    -d '{"kwargs": {"config": {"hidden_size": 4096, "intermediate_size": 11008, "hidden_act": "silu",
                               "pretraining_tp": 1, "tp": 4}}}'; echo
# {...,"dispatch_mode":"ONE_TO_ALL","output":[null,null,null,null]}

# run_layer takes one x per dp rank (a list of 1). The tutorial's x is [2048, 16, 4096]
# (512 MiB); these steps use [8, 2, 4096]. JSON first:
python3 - "$TMP/run_layer.json" <<'PY'
import json, random, sys
random.seed(0)
shape = [8, 2, 4096]
x = {"datatype": "FP32", "shape": shape, "data": [random.random() for _ in range(8 * 2 * 4096)]}
json.dump({"kwargs": {"x": [x]}}, open(sys.argv[1], "w"))
PY
curl -sS "${AUTH[@]}" "${JSON[@]}" -X POST "$URL/v1/groups/mlp/run_layer" --data-binary @"$TMP/run_layer.json" \
    -o "$TMP/run_layer.out.json"
python3 -c 'import json,sys; a=json.load(open(sys.argv[1])); print(a.get("error") or [(o["datatype"], o["shape"]) for o in a["output"]])' \
    "$TMP/run_layer.out.json"
# [('FP32', [8, 2, 4096])]

# ---------------------------------------------------------------------------------------
step "Open Inference Protocol (/v2): metadata"
curl -sS "$URL/v2/health/live" -o /dev/null -w 'live %{http_code}\n'      # live 200
curl -sS "$URL/v2/health/ready" -o /dev/null -w 'ready %{http_code}\n'    # ready 200
curl -sS "${AUTH[@]}" "$URL/v2"; echo
# {"name":"hybridflow-single-controller","version":"0.1.0","extensions":["binary_tensor_data"]}
curl -sS "${AUTH[@]}" "$URL/v2/models/mlp"; echo
# {"name":"mlp","versions":["1"],"platform":"pytorch_megatron_core",
#  "inputs":[{"name":"x","datatype":"FP32","shape":[-1,-1,4096]}],"outputs":[{"name":"y","datatype":"FP32","shape":[-1,-1,4096]}]}

step "Open Inference Protocol: infer with JSON data"
python3 - "$TMP/infer.json" <<'PY'
import json, sys
x = {"name": "x", "datatype": "FP32", "shape": [1, 1, 4096], "data": [0.01] * 4096}
json.dump({"id": "json-1", "inputs": [x]}, open(sys.argv[1], "w"))
PY
curl -sS "${AUTH[@]}" "${JSON[@]}" -X POST "$URL/v2/models/mlp/infer" --data-binary @"$TMP/infer.json" \
    | python3 -c 'import json,sys; a=json.load(sys.stdin); print(a.get("error") or [(a["id"], o["name"], o["shape"], len(o["data"])) for o in a["outputs"]])'
# [('json-1', 'y', [1, 1, 4096], 4096)]

step "Open Inference Protocol: infer with the binary tensor data extension"
# Body: JSON header, then x's raw little-endian float32 bytes; the header's length goes in
# Inference-Header-Content-Length. The answer is laid out the same way.
HEADER_LENGTH="$(python3 - "$TMP/infer.bin" <<'PY'
import json, struct, sys
shape = [4, 2, 4096]
count = shape[0] * shape[1] * shape[2]
header = json.dumps({
    "inputs": [{"name": "x", "datatype": "FP32", "shape": shape, "parameters": {"binary_data_size": 4 * count}}],
    "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
}).encode()
with open(sys.argv[1], "wb") as f:
    f.write(header + struct.pack(f"<{count}f", *([0.5] * count)))
print(len(header))
PY
)"
curl -sS "${AUTH[@]}" -X POST "$URL/v2/models/mlp/infer" \
    -H "Content-Type: application/octet-stream" -H "Inference-Header-Content-Length: $HEADER_LENGTH" \
    --data-binary @"$TMP/infer.bin" -D "$TMP/infer.headers" -o "$TMP/infer.out"
python3 - "$TMP/infer.headers" "$TMP/infer.out" <<'PY'
import json, sys
headers = dict(line.split(":", 1) for line in open(sys.argv[1]) if ":" in line)
headers = {k.strip().lower(): v.strip() for k, v in headers.items()}
body = open(sys.argv[2], "rb").read()
n = int(headers.get("inference-header-content-length", len(body)))
answer = json.loads(body[:n])
print(answer.get("error") or [(o["name"], o["shape"], o["parameters"]["binary_data_size"]) for o in answer["outputs"]],
      f"{len(body) - n} bytes after the header")
PY
# [('y', [4, 2, 4096], 131072)] 131072 bytes after the header

step "The same with the Python CLI"
echo 'python -m clients.cli call gpu_accumulator_decorator get_value'
echo 'python -m clients.cli infer mlp --shape 8,2,4096 --random'
