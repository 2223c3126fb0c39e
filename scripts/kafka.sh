#!/usr/bin/env bash
# scripts/kafka.sh - a real Apache Kafka 4.x broker (KRaft mode, combined
# broker+controller) for rtflow's integration tests: one node, or with
# RTFLOW_KAFKA_NODES=3 a replicated cluster of three on this machine
# (replication factor 3, min.insync.replicas=2, internal topics too).
#
# Needs only bash, Java 17+ and Maven: `install` has Maven copy the Kafka jars
# from Maven Central (dependency list: scripts/kafka/pom.xml) into
# target/kafka/libs; `start` formats target/kafka/data once, writes
# target/kafka/server.properties and runs `java kafka.Kafka` in the background,
# then waits until a real Kafka admin client can list topics.
#
#   scripts/kafka.sh install             fetch the jars (no-op when present)
#   scripts/kafka.sh start               install if needed, start, wait for ready
#   scripts/kafka.sh stop [--clean]      SIGTERM (then SIGKILL); --clean wipes data
#   scripts/kafka.sh restart             stop + start
#   scripts/kafka.sh status              exit 0 if running, 1 if not
#   scripts/kafka.sh topic create NAME PARTITIONS   (no-op if it exists)
#   scripts/kafka.sh topic delete NAME              (no-op if missing)
#   scripts/kafka.sh topic list | describe [NAME]
#   scripts/kafka.sh produce TOPIC            send stdin lines ("key<TAB>value" with --keyed)
#   scripts/kafka.sh consume TOPIC MAX [MS]   print up to MAX records from the beginning
#   scripts/kafka.sh tool MAIN_CLASS [ARGS]  run any class from the Kafka jars
#   scripts/kafka.sh bootstrap           print the bootstrap servers
#   scripts/kafka.sh node N start|stop|kill|pid   one node of a cluster (kill: SIGKILL)
#
# Environment (all optional):
#   RTFLOW_KAFKA_NODES=1               1, or 3 for a replicated cluster
#   RTFLOW_KAFKA_PORT=9092             client listener on 127.0.0.1 (a cluster:
#                                      19092 by default; node N listens on
#                                      PORT+2(N-1), its controller on the next)
#   RTFLOW_KAFKA_CONTROLLER_PORT=9093  KRaft controller listener on 127.0.0.1
#   RTFLOW_KAFKA_VERSION=4.1.1         Kafka version to install
#   RTFLOW_KAFKA_DIR=<repo>/target/kafka  where jars, data, logs, pid live
#                                      (a cluster: node N's in <dir>/cluster/nodeN)
#   RTFLOW_KAFKA_START_TIMEOUT=60      seconds to wait for the broker
#   RTFLOW_KAFKA_HEAP_OPTS="-Xms256m -Xmx512m"   broker heap
#   JAVA_HOME                          java to use (else `java` on PATH)
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"

NODES="${RTFLOW_KAFKA_NODES:-1}"
[[ "$NODES" == 1 || "$NODES" == 3 ]] || { echo "kafka: RTFLOW_KAFKA_NODES is 1 or 3" >&2; exit 2; }
if ((NODES == 1)); then
    PORT="${RTFLOW_KAFKA_PORT:-9092}"
    CPORT="${RTFLOW_KAFKA_CONTROLLER_PORT:-9093}"
else
    PORT="${RTFLOW_KAFKA_PORT:-19092}"
fi
BASE_PORT="$PORT"
VERSION="${RTFLOW_KAFKA_VERSION:-4.1.1}"
KDIR="${RTFLOW_KAFKA_DIR:-$ROOT/target/kafka}"
START_TIMEOUT="${RTFLOW_KAFKA_START_TIMEOUT:-60}"
HEAP_OPTS="${RTFLOW_KAFKA_HEAP_OPTS:--Xms256m -Xmx512m}"

LIBS="$KDIR/libs"
LOG4J_TOOLS="$KDIR/log4j2-tools.properties"
JAVA="${JAVA_HOME:+$JAVA_HOME/bin/}java"

# The files and ports of node $1: a single broker keeps the layout it always
# had; a cluster's nodes live side by side under $KDIR/cluster.
select_node() {
    NODE="$1"
    if ((NODES == 1)); then
        NODE_DIR="$KDIR"
    else
        NODE_DIR="$KDIR/cluster/node$NODE"
        PORT=$((BASE_PORT + 2 * (NODE - 1)))
        CPORT=$((PORT + 1))
    fi
    DATA="$NODE_DIR/data"
    LOGS="$NODE_DIR/logs"
    PIDFILE="$NODE_DIR/kafka.pid"
    PROPS="$NODE_DIR/server.properties"
    LOG4J_SERVER="$NODE_DIR/log4j2-server.properties"
}
select_node 1

# Every node's client listener, as clients bootstrap.
all_bootstrap() {
    local n list=()
    for ((n = 1; n <= NODES; n++)); do
        list+=("127.0.0.1:$((BASE_PORT + 2 * (n - 1)))")
    done
    (IFS=,; echo "${list[*]}")
}

# The controller quorum: every node votes.
quorum_voters() {
    if ((NODES == 1)); then
        echo "1@127.0.0.1:$CPORT"
        return 0
    fi
    local n list=()
    for ((n = 1; n <= NODES; n++)); do
        list+=("$n@127.0.0.1:$((BASE_PORT + 2 * (n - 1) + 1))")
    done
    (IFS=,; echo "${list[*]}")
}

# Short-lived CLI JVMs: start fast, stay small (the machine has 2 cores).
TOOL_JVM_OPTS=(-Xmx256m -XX:+UseSerialGC -XX:TieredStopAtLevel=1 -Djava.awt.headless=true)

log() { echo "kafka: $*"; }
die() { echo "kafka: error: $*" >&2; exit 1; }

# ---------------------------------------------------------------- install ---

installed() {
    [[ -f "$LIBS/.version" && "$(cat "$LIBS/.version")" == "$VERSION" &&
       -f "$LIBS/kafka_2.13-$VERSION.jar" ]]
}

cmd_install() {
    if installed; then
        log "$VERSION already installed in $LIBS"
        return 0
    fi
    command -v mvn >/dev/null || die "mvn not found (apt-get install maven)"
    command -v "$JAVA" >/dev/null || die "java not found"
    mkdir -p "$KDIR"
    local tmp="$KDIR/libs.tmp" mvnlog="$KDIR/install.log"
    rm -rf "$tmp"
    log "installing Kafka $VERSION from Maven Central into $LIBS"
    # Debian's Maven 3.8 prints stray ANSI resets even with -q -B, so keep its
    # output in a file and show it only when something went wrong.
    if ! mvn -q -B -f "$SCRIPT_DIR/kafka/pom.xml" \
            -Dkafka.version="$VERSION" -Dkafka.libs.dir="$tmp" \
            dependency:copy-dependencies >"$mvnlog" 2>&1; then
        cat "$mvnlog" >&2
        die "maven could not fetch Kafka $VERSION"
    fi
    [[ -f "$tmp/kafka_2.13-$VERSION.jar" ]] || die "kafka_2.13-$VERSION.jar missing after install"
    echo "$VERSION" >"$tmp/.version"
    rm -rf "$LIBS"
    mv "$tmp" "$LIBS"
    log "installed $(find "$LIBS" -name '*.jar' | wc -l) jars"
}

# ------------------------------------------------------------ helpers ---

# Pid of our broker if it is alive (checks the command line, so a stale pid
# file whose number was reused by another process is not mistaken for it).
broker_pid() {
    [[ -f "$PIDFILE" ]] || return 1
    local pid
    pid="$(cat "$PIDFILE" 2>/dev/null || true)"
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    kill -0 "$pid" 2>/dev/null || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "kafka.Kafka $PROPS" || return 1
    echo "$pid"
}

# Without explicit port variables, talk to the broker that is running (it may
# have been started with other ports) rather than assume the defaults.
RUNNING_PORT=""
resolve_ports() {
    if ((NODES > 1)); then
        BOOTSTRAP="$(all_bootstrap)"
        return 0
    fi
    if broker_pid >/dev/null; then
        RUNNING_PORT="$(sed -n 's|^listeners=PLAINTEXT://127.0.0.1:\([0-9]*\),.*|\1|p' "$PROPS")"
        if [[ -z "${RTFLOW_KAFKA_PORT:-}${RTFLOW_KAFKA_CONTROLLER_PORT:-}" ]]; then
            PORT="$RUNNING_PORT"
            CPORT="$(sed -n 's|^controller.quorum.voters=1@127.0.0.1:\([0-9]*\)$|\1|p' "$PROPS")"
        fi
    fi
    BOOTSTRAP="127.0.0.1:$PORT"
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Run a main class from the Kafka jars with a quiet (stderr, WARN) log config,
# killed after $TOOL_TIMEOUT seconds if that is set.
run_tool() {
    installed || die "Kafka $VERSION is not installed; run: $0 install"
    write_log4j
    local limit=()
    [[ -n "${TOOL_TIMEOUT:-}" ]] && limit=(timeout "$TOOL_TIMEOUT")
    "${limit[@]}" "$JAVA" "${TOOL_JVM_OPTS[@]}" -Dlog4j2.configurationFile="$LOG4J_TOOLS" \
        -cp "$LIBS/*" "$@"
}

write_log4j() {
    mkdir -p "$LOGS" "$KDIR"
    cat >"$LOG4J_SERVER" <<EOF
# Generated by scripts/kafka.sh: the broker logs to $LOGS/server.log.
status = warn
appender.file.type = RollingFile
appender.file.name = FILE
appender.file.fileName = $LOGS/server.log
appender.file.filePattern = $LOGS/server.log.%i
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
appender.file.policies.type = Policies
appender.file.policies.size.type = SizeBasedTriggeringPolicy
appender.file.policies.size.size = 50MB
appender.file.strategy.type = DefaultRolloverStrategy
appender.file.strategy.max = 2
rootLogger.level = info
rootLogger.appenderRef.file.ref = FILE
logger.request.name = kafka.request.logger
logger.request.level = warn
logger.clients.name = org.apache.kafka.clients
logger.clients.level = warn
EOF
    cat >"$LOG4J_TOOLS" <<EOF
# Generated by scripts/kafka.sh: CLI tools only report warnings, on stderr.
status = warn
appender.err.type = Console
appender.err.name = STDERR
appender.err.target = SYSTEM_ERR
appender.err.layout.type = PatternLayout
appender.err.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = warn
rootLogger.appenderRef.err.ref = STDERR
EOF
}

write_props() {
    local replicas=1 isr=1 roles="# Single node, combined broker + KRaft controller, plaintext on loopback."
    if ((NODES > 1)); then
        replicas=3 isr=2
        roles="# Node $NODE of $NODES, each a combined broker + KRaft controller, plaintext on loopback."
    fi
    mkdir -p "$NODE_DIR"
    cat >"$PROPS" <<EOF
# Generated by scripts/kafka.sh on each start; edits are overwritten.
$roles
process.roles=broker,controller
node.id=$NODE
controller.quorum.voters=$(quorum_voters)
listeners=PLAINTEXT://127.0.0.1:$PORT,CONTROLLER://127.0.0.1:$CPORT
advertised.listeners=PLAINTEXT://127.0.0.1:$PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$DATA

# Every topic, internal ones too, has $replicas replica(s); a write needs $isr in sync.
offsets.topic.replication.factor=$replicas
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=$replicas
transaction.state.log.min.isr=$isr
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=$replicas
share.coordinator.state.topic.min.isr=$isr
share.coordinator.state.topic.num.partitions=4
default.replication.factor=$replicas
min.insync.replicas=$isr

# Test-friendly behaviour.
auto.create.topics.enable=false
delete.topic.enable=true
num.partitions=1
group.initial.rebalance.delay.ms=0

# Small footprint for a 2-core machine.
num.network.threads=2
num.io.threads=2
background.threads=2
num.recovery.threads.per.data.dir=1
log.segment.bytes=16777216
log.retention.hours=24
log.retention.check.interval.ms=60000
log.cleaner.threads=1
log.cleaner.dedupe.buffer.size=8388608
EOF
}

# Format the KRaft storage once (meta.properties marks a formatted dir).
format_storage() {
    [[ -f "$DATA/meta.properties" ]] && return 0
    log "formatting KRaft storage in $DATA"
    mkdir -p "$DATA"
    local cluster_id idfile="$KDIR/cluster/cluster.id"
    if ((NODES == 1)); then
        cluster_id="$(run_tool kafka.tools.StorageTool random-uuid)"
    else
        # The nodes of one cluster share its id.
        mkdir -p "$KDIR/cluster"
        [[ -s "$idfile" ]] || run_tool kafka.tools.StorageTool random-uuid >"$idfile"
        cluster_id="$(cat "$idfile")"
    fi
    run_tool kafka.tools.StorageTool format --ignore-formatted \
        --cluster-id "$cluster_id" --config "$PROPS" >"$LOGS/format.log" 2>&1 || {
        cat "$LOGS/format.log" >&2
        die "storage format failed"
    }
}

# Ready = an admin client gets a topic list back from the broker within $1 s.
broker_ready() {
    TOOL_TIMEOUT="$1" run_tool org.apache.kafka.tools.TopicCommand \
        --bootstrap-server "$BOOTSTRAP" --list >/dev/null 2>&1
}

show_log_tail() {
    local f
    for f in "$LOGS/kafka.out" "$LOGS/server.log"; do
        [[ -s "$f" ]] || continue
        echo "---- tail of $f ----" >&2
        tail -n 30 "$f" >&2
    done
}

# ------------------------------------------------------ start/stop/status ---

# Starts the selected node in the background (formatting its storage first).
launch_node() {
    rm -f "$PIDFILE"
    for p in "$PORT" "$CPORT"; do
        port_open "$p" && die "port 127.0.0.1:$p is already in use by another process"
    done
    mkdir -p "$LOGS"
    # Each start gets fresh logs; the previous run's are kept as *.prev.
    local f
    for f in server.log kafka.out; do
        [[ -f "$LOGS/$f" ]] && mv -f "$LOGS/$f" "$LOGS/$f.prev"
    done
    write_log4j
    write_props
    format_storage

    local pid heap which=""
    ((NODES > 1)) && which=" node $NODE"
    read -r -a heap <<<"$HEAP_OPTS"
    # setsid: the broker outlives the shell (and Ctrl-C) that started it.
    setsid nohup "$JAVA" "${heap[@]}" \
        -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:InitiatingHeapOccupancyPercent=35 \
        -XX:+ExplicitGCInvokesConcurrent -XX:+ExitOnOutOfMemoryError \
        -Djava.awt.headless=true \
        -Dlog4j2.configurationFile="$LOG4J_SERVER" -Dkafka.logs.dir="$LOGS" \
        -cp "$LIBS/*" kafka.Kafka "$PROPS" \
        >"$LOGS/kafka.out" 2>&1 </dev/null &
    pid=$!
    echo "$pid" >"$PIDFILE"
    log "starting Kafka $VERSION$which (pid $pid), logs in $LOGS"
}

# Waits until the selected node answers a real client round trip.
await_node() {
    local t0=$SECONDS pid
    pid="$(cat "$PIDFILE")"
    # Wait cheaply for the port, then for a real client round trip.
    local deadline=$((SECONDS + START_TIMEOUT))
    while ((SECONDS < deadline)); do
        if ! kill -0 "$pid" 2>/dev/null; then
            rm -f "$PIDFILE"
            show_log_tail
            die "broker exited during startup"
        fi
        if port_open "$PORT" &&
            BOOTSTRAP="127.0.0.1:$PORT" broker_ready $((deadline - SECONDS + 1)); then
            log "ready at 127.0.0.1:$PORT (started in $((SECONDS - t0))s)"
            return 0
        fi
        sleep 0.5
    done
    show_log_tail
    stop_node >/dev/null 2>&1 || true
    die "broker not ready after ${START_TIMEOUT}s"
}

cmd_start() {
    local pid n
    if ((NODES == 1)) && pid="$(broker_pid)"; then
        [[ "$RUNNING_PORT" == "$PORT" ]] ||
            die "already running (pid $pid) at 127.0.0.1:$RUNNING_PORT, not $PORT; stop it first"
        log "already running (pid $pid), ready at $BOOTSTRAP"
        return 0
    fi
    installed || cmd_install
    # A cluster's controllers need a quorum: launch every node, then wait.
    local launched=()
    for ((n = 1; n <= NODES; n++)); do
        select_node "$n"
        if pid="$(broker_pid)"; then
            log "node $n already running (pid $pid)"
        else
            launch_node
            launched+=("$n")
        fi
    done
    for n in "${launched[@]}"; do
        select_node "$n"
        await_node
    done
    ((NODES == 1)) || log "cluster of $NODES ready at $(all_bootstrap)"
}

# Stops the selected node: SIGTERM for a controlled shutdown, then SIGKILL.
stop_node() {
    local pid
    if pid="$(broker_pid)"; then
        log "stopping (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        local i
        for ((i = 0; i < 60; i++)); do   # 30 s for a controlled shutdown
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
        if kill -0 "$pid" 2>/dev/null; then
            log "still alive after 30s, sending SIGKILL"
            kill_node
        fi
        log "stopped"
    else
        log "not running"
    fi
    rm -f "$PIDFILE"
}

# SIGKILLs the selected node, as a crash would end it.
kill_node() {
    local pid i
    pid="$(broker_pid)" || { log "not running"; return 0; }
    kill -KILL "$pid" 2>/dev/null || true
    for ((i = 0; i < 20; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.25
    done
    rm -f "$PIDFILE"
}

cmd_stop() {
    local clean=0 n pid
    [[ "${1:-}" == "--clean" ]] && clean=1
    # A cluster's nodes are told at once: stopped one by one, the last ones
    # would wait for a controller quorum that is already gone.
    if ((NODES > 1)); then
        for ((n = 1; n <= NODES; n++)); do
            select_node "$n"
            if pid="$(broker_pid)"; then kill -TERM "$pid" 2>/dev/null || true; fi
        done
    fi
    for ((n = 1; n <= NODES; n++)); do
        select_node "$n"
        stop_node
        if ((clean)); then
            rm -rf "$DATA" "$LOGS"
            log "removed $DATA and $LOGS"
        fi
    done
    ((clean && NODES > 1)) && rm -f "$KDIR/cluster/cluster.id"
    return 0
}

cmd_status() {
    local pid n down=0
    for ((n = 1; n <= NODES; n++)); do
        select_node "$n"
        if pid="$(broker_pid)"; then
            if ((NODES == 1)); then
                log "running (pid $pid) at 127.0.0.1:$RUNNING_PORT"
            else
                log "node $n running (pid $pid) at 127.0.0.1:$PORT"
            fi
        elif ((NODES == 1)); then
            log "not running"
            down=1
        else
            log "node $n not running"
            down=1
        fi
    done
    return "$down"
}

# node N start|stop|kill|pid: one node of the cluster, for chaos tests.
cmd_node() {
    (($# == 2)) && [[ "$1" =~ ^[0-9]+$ ]] && (($1 >= 1 && $1 <= NODES)) ||
        die "usage: $0 node N start|stop|kill|pid (N from 1 to $NODES)"
    select_node "$1"
    case "$2" in
        start)
            installed || cmd_install
            broker_pid >/dev/null && { log "node $1 already running"; return 0; }
            launch_node
            await_node ;;
        stop) stop_node ;;
        kill) kill_node; log "node $1 killed" ;;
        pid) broker_pid ;;
        *) die "usage: $0 node N start|stop|kill|pid" ;;
    esac
}

# ------------------------------------------------------ topics and data ---

cmd_topic() {
    local sub="${1:-}"
    shift || true
    local tc=(org.apache.kafka.tools.TopicCommand --bootstrap-server "$BOOTSTRAP")
    case "$sub" in
        create)
            (($# >= 2)) || die "usage: $0 topic create NAME PARTITIONS [extra TopicCommand args]"
            local name="$1" parts="$2"
            shift 2
            run_tool "${tc[@]}" --create --if-not-exists --topic "$name" \
                --partitions "$parts" "$@" ;;
        delete)
            (($# >= 1)) || die "usage: $0 topic delete NAME"
            run_tool "${tc[@]}" --delete --if-exists --topic "$1" ;;
        list)
            run_tool "${tc[@]}" --list ;;
        describe)
            run_tool "${tc[@]}" --describe ${1:+--topic "$1"} ;;
        *)
            die "usage: $0 topic create NAME PARTITIONS | delete NAME | list | describe [NAME]" ;;
    esac
}

# produce TOPIC [--keyed]: one record per stdin line; with --keyed each line
# is "key<TAB>value".
cmd_produce() {
    (($# >= 1)) || die "usage: $0 produce TOPIC [--keyed] < lines"
    local topic="$1" keyed=()
    [[ "${2:-}" == "--keyed" ]] && keyed=(--property parse.key=true --property key.separator=$'\t')
    # --max-block-ms: give up after 15 s (not the default 60 s) if e.g. the topic
    # is missing. The console producer reports failed sends only in its log and
    # still exits 0, so look for those reports to fail properly.
    local err="$KDIR/produce.$$.err" rc=0
    run_tool org.apache.kafka.tools.ConsoleProducer --bootstrap-server "$BOOTSTRAP" \
        --topic "$topic" --max-block-ms 15000 "${keyed[@]}" 2>"$err" || rc=$?
    cat "$err" >&2
    grep -q 'Error when sending message' "$err" && rc=1
    rm -f "$err"
    return "$rc"
}

# consume TOPIC MAX [TIMEOUT_MS]: print up to MAX records from the beginning,
# one per line as "Partition:N<TAB>key<TAB>value"; stops early (still exit 0)
# after TIMEOUT_MS (default 10000) without a new record. The tool's own
# "timed out" and "Processed a total of" chatter on stderr is dropped.
cmd_consume() {
    (($# >= 2)) || die "usage: $0 consume TOPIC MAX [TIMEOUT_MS]"
    {
        run_tool org.apache.kafka.tools.consumer.ConsoleConsumer \
            --bootstrap-server "$BOOTSTRAP" --topic "$1" --from-beginning \
            --max-messages "$2" --timeout-ms "${3:-10000}" \
            --property print.partition=true --property print.key=true \
            --property key.separator=$'\t' 2>&1 1>&3 |
            { grep -v -e 'Error processing message, terminating consumer process: *(' \
                -e '^org.apache.kafka.common.errors.TimeoutException' \
                -e '^Processed a total of' >&2 || true; }
    } 3>&1
}

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
}

main() {
    local cmd="${1:-help}"
    shift || true
    resolve_ports
    case "$cmd" in
        install) cmd_install ;;
        start) cmd_start ;;
        stop) cmd_stop "$@" ;;
        restart) cmd_stop; cmd_start ;;
        status) cmd_status ;;
        bootstrap) echo "$BOOTSTRAP" ;;
        node) cmd_node "$@" ;;
        topic) cmd_topic "$@" ;;
        produce) cmd_produce "$@" ;;
        consume) cmd_consume "$@" ;;
        tool) run_tool "$@" ;;
        help | -h | --help) usage ;;
        *) usage >&2; exit 2 ;;
    esac
}

main "$@"
