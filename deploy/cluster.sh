#!/usr/bin/env bash
# A two-node Ray cluster from the image on one Docker network: a head container and a
# worker container, each with its own CPU count, the application deployed to it with
# `serve deploy` and served on the head's port 8000.
#
#   deploy/cluster.sh up                 # network, head, worker; waits for both nodes
#   deploy/cluster.sh deploy [CONFIG]    # serve deploy CONFIG (default: the image's serve_config.yaml)
#   deploy/cluster.sh status             # serve status
#   deploy/cluster.sh stop-worker        # docker stop the worker (its node leaves the cluster)
#   deploy/cluster.sh start-worker       # start it again: it rejoins as a new node
#   deploy/cluster.sh down               # remove the containers, the network and the state volume
#
# Settings (environment):
#   IMAGE        image to run (hybridflow-serve)
#   NAME         prefix of every Docker object made here (hybridflow): NAME-net, NAME-head,
#                NAME-worker, NAME-state
#   PORT         host port of the head's HTTP port 8000 (8000); HOST_IP the address it binds (127.0.0.1)
#   HEAD_CPUS, WORKER_CPUS   logical CPUs each node offers Ray (2, 2)
#   SHM_SIZE     /dev/shm of each container, Ray's object store (2g)
#   HYBRIDFLOW_TOKEN            passed to both nodes when set
#   DASHBOARD_PORT           also publish the head's dashboard (8265) on this host port
set -euo pipefail

IMAGE=${IMAGE:-hybridflow-serve}
NAME=${NAME:-hybridflow}
PORT=${PORT:-8000}
HOST_IP=${HOST_IP:-127.0.0.1}
HEAD_CPUS=${HEAD_CPUS:-2}
WORKER_CPUS=${WORKER_CPUS:-2}
SHM_SIZE=${SHM_SIZE:-2g}
NETWORK=$NAME-net
HEAD=$NAME-head
WORKER=$NAME-worker
# The controllers' durable state (serve config `state.path`, relative to the app folder)
# on a volume both nodes mount, so a controller replica restarted on either node finds it.
STATE_VOLUME=$NAME-state
APP_DIR=/home/hybridflow/app

env_args=()
if [[ -n "${HYBRIDFLOW_TOKEN:-}" ]]; then env_args+=(-e "HYBRIDFLOW_TOKEN=$HYBRIDFLOW_TOKEN"); fi

node_args=(--init --network "$NETWORK" --shm-size "$SHM_SIZE" -v "$STATE_VOLUME:$APP_DIR/.hybridflow"
           "${env_args[@]}")

worker_ids() {  # the worker nodes the head's GCS counts as alive
    docker exec "$HEAD" ray list nodes --format json --limit 100 2>/dev/null | python3 -c '
import json, sys
print(" ".join(n["node_id"] for n in json.load(sys.stdin) if n["state"] == "ALIVE" and not n["is_head_node"]))
' 2>/dev/null || true
}

wait_head() {  # until the head's GCS answers
    local deadline=$((SECONDS + 180))
    until docker exec "$HEAD" ray list nodes --limit 1 >/dev/null 2>&1; do
        if ((SECONDS > deadline)); then
            echo "cluster: $HEAD did not come up within 180 s:" >&2
            docker logs --tail 20 "$HEAD" >&2
            return 1
        fi
        sleep 2
    done
}

wait_new_worker() {  # wait_new_worker "IDS BEFORE": until a worker node not among them is alive
    local deadline=$((SECONDS + 180)) id
    while ((SECONDS < deadline)); do
        for id in $(worker_ids); do
            if [[ " $1 " != *" $id "* ]]; then return 0; fi
        done
        sleep 2
    done
    echo "cluster: $WORKER did not join within 180 s:" >&2
    docker logs --tail 20 "$WORKER" >&2
    return 1
}

start_worker_container() {
    docker run -d --name "$WORKER" --hostname "$WORKER" "${node_args[@]}" "$IMAGE" \
        ray start --address="$HEAD:6379" --num-cpus="$WORKER_CPUS" --num-gpus=0 --block >/dev/null
}

case "${1:-}" in
up)
    docker network create "$NETWORK" >/dev/null
    docker volume create "$STATE_VOLUME" >/dev/null
    publish=(-p "$HOST_IP:$PORT:8000")
    if [[ -n "${DASHBOARD_PORT:-}" ]]; then publish+=(-p "$HOST_IP:$DASHBOARD_PORT:8265"); fi
    docker run -d --name "$HEAD" --hostname "$HEAD" "${node_args[@]}" "${publish[@]}" "$IMAGE" \
        ray start --head --port=6379 --num-cpus="$HEAD_CPUS" --num-gpus=0 \
        --dashboard-host=0.0.0.0 --disable-usage-stats --block >/dev/null
    wait_head
    start_worker_container
    wait_new_worker ""
    echo "cluster: $HEAD ($HEAD_CPUS CPUs) and $WORKER ($WORKER_CPUS CPUs) on $NETWORK; HTTP on $HOST_IP:$PORT"
    ;;
deploy)
    config=$APP_DIR/serve_config.yaml
    if [[ -n "${2:-}" ]]; then
        docker cp "$2" "$HEAD:/tmp/serve_config.yaml"
        config=/tmp/serve_config.yaml
    fi
    docker exec "$HEAD" serve deploy "$config"
    ;;
status)
    docker exec "$HEAD" serve status
    ;;
stop-worker)
    # docker stop: SIGTERM, then SIGKILL after 10 s. The engine sometimes reports a kill
    # whose exit it did not see in time; the container is stopped once it is not running.
    docker stop "$WORKER" >/dev/null 2>&1 || true
    for _ in $(seq 30); do
        if [[ "$(docker inspect -f '{{.State.Running}}' "$WORKER")" == false ]]; then exit 0; fi
        docker kill "$WORKER" >/dev/null 2>&1 || true
        sleep 2
    done
    echo "cluster: $WORKER did not stop" >&2
    exit 1
    ;;
start-worker)
    before=$(worker_ids)
    docker start "$WORKER" >/dev/null
    wait_new_worker "$before"
    ;;
down)
    docker rm -f "$HEAD" "$WORKER" >/dev/null 2>&1 || true
    docker network rm "$NETWORK" >/dev/null 2>&1 || true
    docker volume rm "$STATE_VOLUME" >/dev/null 2>&1 || true
    ;;
*)
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
