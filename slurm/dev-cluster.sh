#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for development and CI, from Debian's packages.
#
#   slurm/dev-cluster.sh up       # install missing packages, start munge, MariaDB, slurmdbd, slurmctld, $NODES slurmd
#   source /tmp/megatron-rl-dev-cluster/env.sh    # or: eval "$(slurm/dev-cluster.sh up)"
#   slurm/dev-cluster.sh status   # sinfo + accounting check; exit 1 if the cluster is not up
#   slurm/dev-cluster.sh down     # stop, by PID, only what `up` started; safe when nothing runs
#   slurm/dev-cluster.sh restart-controller   # stop slurmctld and start it again from its saved state (jobs go on)
#
# Needs root; no systemd. Nodes are several slurmd on this host (NodeAddr=127.0.0.1, one port each), named
# n1..nN, with /etc/hosts lines so the names resolve; network namespaces would give distinct hostnames but
# need client commands to run inside a hub namespace, which every caller of sbatch/sacct would have to know.
# `up` prints `export ...` lines on stdout (progress goes to stderr) and writes them to $DEV_CLUSTER_DIR/env.sh.
#
# Environment:
#   DEV_CLUSTER_DIR   state folder (default /tmp/megatron-rl-dev-cluster): configs, logs, pid files, database
#   NODES             slurmd nodes (default 2)
#   NODE_CPUS         CPUs per node (default 4; overcommitting the host's cores is intended)
#   NODE_MEM_MB       RealMemory per node (default: host memory / NODES)
#   DEV_CLUSTER_CTLD_PORT / _DBD_PORT / _DB_PORT / _SLURMD_PORT  ports (6817, 6819, 3306, first of N from 17001)
#   DEV_CLUSTER_CRED_EXPIRE   job credential lifetime, also the hold of a requeued job, in s (default 10)
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly SCRIPT_DIR
readonly TEMPLATE_DIR="$SCRIPT_DIR/dev-cluster"
readonly DIR="${DEV_CLUSTER_DIR:-/tmp/megatron-rl-dev-cluster}"
readonly MARKER_FILE="$DIR/.megatron-rl-dev-cluster"
readonly HOSTS_FILE="${DEV_CLUSTER_HOSTS_FILE:-/etc/hosts}"
readonly HOSTS_TAG="# megatron-rl-dev-cluster $DIR"
readonly CLUSTER_NAME="devcluster"
readonly CTLD_PORT="${DEV_CLUSTER_CTLD_PORT:-6817}"
readonly DBD_PORT="${DEV_CLUSTER_DBD_PORT:-6819}"
readonly DB_PORT="${DEV_CLUSTER_DB_PORT:-3306}"
readonly SLURMD_PORT="${DEV_CLUSTER_SLURMD_PORT:-17001}"
readonly CRED_EXPIRE="${DEV_CLUSTER_CRED_EXPIRE:-10}"
readonly PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
readonly MUNGE_SOCKET="$DIR/munge/munge.socket"
readonly DB_SOCKET="$DIR/mysql/mysqld.sock"
export SLURM_CONF="$DIR/etc/slurm.conf"

log() { printf 'dev-cluster: %s\n' "$*" >&2; }
die() { printf 'dev-cluster: error: %s\n' "$*" >&2; exit 1; }

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" >&2
}

require_int() {  # NAME VALUE
    [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "$1='$2' must be a positive integer"
}

check_settings() {
    [[ "$DIR" =~ ^/[A-Za-z0-9._/+-]+$ ]] \
        || die "DEV_CLUSTER_DIR='$DIR' must be an absolute path of letters, digits and ._/+- (slurm.conf cannot quote paths)"
    [[ "$DIR" != "/" && "$DIR" != "/tmp" && "$DIR" != "/tmp/" ]] || die "DEV_CLUSTER_DIR='$DIR' is not a dedicated folder"
    local name
    for name in CTLD_PORT DBD_PORT DB_PORT SLURMD_PORT CRED_EXPIRE; do require_int "$name" "${!name}"; done
    for name in CTLD_PORT DBD_PORT DB_PORT SLURMD_PORT; do
        ((${!name} < 65536 - NODES)) || die "DEV_CLUSTER_$name=${!name} is not a TCP port below $((65536 - NODES))"
    done
}

# --- processes, by pid file -------------------------------------------------------------------------------------

pid_from_file() {  # PIDFILE -> prints the pid if the file holds one
    local pid=""
    if [[ -r "$1" ]]; then read -r pid <"$1" || true; fi
    [[ "$pid" =~ ^[0-9]+$ ]] && printf '%s' "$pid"
}

pid_is() {  # PID PROGRAM: true if PID is alive and runs /usr/sbin/PROGRAM (guards against a reused pid)
    local exe target
    exe="$(readlink "/proc/$1/exe" 2>/dev/null)" || return 1
    exe="${exe% (deleted)}"
    # Debian installs slurmctld and slurmd as alternatives: /usr/sbin/slurmd -> /usr/sbin/slurmd-wlm.
    target="$(readlink -f "/usr/sbin/$2" 2>/dev/null)" || target=""
    [[ "$exe" == */"$2" || ( -n "$target" && "$exe" == "$target" ) ]]
}

running() {  # PIDFILE PROGRAM
    local pid
    pid="$(pid_from_file "$1")" || return 1
    pid_is "$pid" "$2"
}

stop_pid() {  # PID PROGRAM LABEL: SIGTERM, then SIGKILL after 15 s
    local pid="$1" program="$2" label="$3" i
    pid_is "$pid" "$program" || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 150; i++)); do
        pid_is "$pid" "$program" || { log "stopped $label (pid $pid)"; return 0; }
        sleep 0.1
    done
    log "$label (pid $pid) ignored SIGTERM for 15 s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
}

stop_pid_file() {  # PIDFILE PROGRAM LABEL
    local pid
    if pid="$(pid_from_file "$1")"; then stop_pid "$pid" "$2" "$3"; fi
    rm -f "$1"
}

# Runs a daemon that forks itself into the background. Its early errors go to $DIR/log/daemon-start.log; the lock's
# fd 9 is closed so that no daemon holds the lock after this script ends.
start_daemon() {  # LABEL LOGFILE COMMAND...
    local label="$1" logfile="$2"
    shift 2
    if ! "$@" </dev/null >>"$DIR/log/daemon-start.log" 2>&1 9>&-; then
        log "$label failed to start; last lines of $DIR/log/daemon-start.log and $logfile:"
        tail -n 10 "$DIR/log/daemon-start.log" "$logfile" >&2 2>/dev/null || true
        die "$label failed to start (see $logfile)"
    fi
}

wait_for() {  # SECONDS DESCRIPTION LOGFILE COMMAND...: poll COMMAND every 0.1 s
    local seconds="$1" what="$2" logfile="$3" i
    shift 3
    for ((i = 0; i < seconds * 10; i++)); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    log "timed out after ${seconds}s waiting for $what; last lines of $logfile:"
    tail -n 20 "$logfile" >&2 2>/dev/null || true
    die "$what did not come up (see $logfile)"
}

# --- packages ---------------------------------------------------------------------------------------------------

install_packages() {
    local missing=() pkg created_policy=0
    for pkg in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
    done
    ((${#missing[@]})) || return 0
    command -v apt-get >/dev/null || die "packages ${missing[*]} are missing and apt-get is not available"
    ((EUID == 0)) || die "packages ${missing[*]} are missing; run as root to install them"
    log "installing ${missing[*]} (apt-get)"
    # Keep the packages' init scripts from starting system-wide daemons: this script runs its own.
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        created_policy=1
    fi
    local rc=0
    if ! apt-cache show "${missing[@]}" >/dev/null 2>&1; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || rc=$?
    fi
    if ((rc == 0)); then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 </dev/null || rc=$?
    fi
    if ((created_policy)); then rm -f /usr/sbin/policy-rc.d; fi
    ((rc == 0)) || die "apt-get install ${missing[*]} failed (exit $rc)"
}

# --- /etc/hosts -------------------------------------------------------------------------------------------------

node_names() { local i; for ((i = 1; i <= NODES; i++)); do printf 'n%d\n' "$i"; done; }

set_node_names() { mapfile -t NODE_NAMES < <(node_names); }

write_hosts_file() {  # CONTENT: rewrite in place (a bind-mounted /etc/hosts cannot be replaced by rename)
    printf '%s' "$1" >"$HOSTS_FILE"
}

add_hosts_entries() {
    local name content added=""
    content="$(cat "$HOSTS_FILE")"$'\n'
    for name in "${NODE_NAMES[@]}"; do
        if ! awk -v n="$name" '!/^[[:space:]]*#/ { for (i = 2; i <= NF && $i !~ /^#/; i++) if ($i == n) found = 1 } END { exit !found }' \
            "$HOSTS_FILE"; then
            content+="127.0.0.1 $name $HOSTS_TAG"$'\n'
            added+=" $name"
        fi
    done
    [[ -z "$added" ]] || { write_hosts_file "$content"; log "added to $HOSTS_FILE:$added"; }
}

remove_hosts_entries() {
    [[ -f "$HOSTS_FILE" ]] || return 0
    grep -qF -- "$HOSTS_TAG" "$HOSTS_FILE" || return 0
    local kept
    kept="$(awk -v tag="$HOSTS_TAG" 'index($0, tag) == 0 || substr($0, length($0) - length(tag) + 1) != tag' "$HOSTS_FILE")"
    write_hosts_file "${kept:+$kept$'\n'}"
    log "removed this cluster's node names from $HOSTS_FILE"
}

# --- state ------------------------------------------------------------------------------------------------------

core_daemons() {  # lines "PIDFILE PROGRAM LABEL" in start order
    printf '%s\n' \
        "$DIR/munge/munged.pid munged munged" \
        "$DIR/mysql/mysqld.pid mariadbd mariadbd" \
        "$DIR/run/slurmdbd.pid slurmdbd slurmdbd" \
        "$DIR/run/slurmctld.pid slurmctld slurmctld"
}

recorded_nodes() {  # node count of the cluster in $DIR, from env.sh
    local n
    n="$(sed -n "s/^export DEV_CLUSTER_NODES='\([0-9]*\)'$/\1/p" "$DIR/env.sh" 2>/dev/null)"
    printf '%s' "${n:-0}"
}

# Sets CORE_ALIVE to how many core daemons run and DEAD to the labels of those that do not.
count_core_running() {
    local pidfile program label alive=0
    DEAD=()
    while read -r pidfile program label; do
        if running "$pidfile" "$program"; then alive=$((alive + 1)); else DEAD+=("$label"); fi
    done < <(core_daemons)
    CORE_ALIVE="$alive"
}

prepare_state_dir() {
    if [[ -d "$DIR" && -n "$(ls -A "$DIR")" ]]; then
        [[ -f "$MARKER_FILE" ]] || die "$DIR exists, is not empty and was not made by this script; set DEV_CLUSTER_DIR to another folder"
        log "clearing the stopped cluster's state in $DIR"
        find "$DIR" -mindepth 1 -maxdepth 1 -exec rm -rf -- {} +
    fi
    mkdir -p "$DIR"/{etc,run,log,state,spool,munge,mysql}
    chmod 755 "$DIR"
    touch "$MARKER_FILE"
    local name
    for name in "${NODE_NAMES[@]}"; do mkdir -p "$DIR/spool/$name"; done
}

port_in_use() {
    if command -v ss >/dev/null; then
        ss -Hltn "sport = :$1" | grep -q .
    else
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
    fi
}

check_ports_free() {
    local pair i
    local pairs=("$CTLD_PORT DEV_CLUSTER_CTLD_PORT" "$DBD_PORT DEV_CLUSTER_DBD_PORT" "$DB_PORT DEV_CLUSTER_DB_PORT")
    for ((i = 0; i < NODES; i++)); do pairs+=("$((SLURMD_PORT + i)) DEV_CLUSTER_SLURMD_PORT"); done
    for pair in "${pairs[@]}"; do
        if port_in_use "${pair% *}"; then
            die "TCP port ${pair% *} is already in use (another Slurm or MariaDB?); stop that service or set ${pair#* }"
        fi
    done
}

render() {  # TEMPLATE OUT MODE NAME=VALUE...: replace every @NAME@ with VALUE
    local template="$1" out="$2" mode="$3" text pair
    shift 3
    text="$(<"$template")"
    for pair in "$@"; do text="${text//@${pair%%=*}@/${pair#*=}}"; done
    [[ "$text" != *@[A-Z_]*@* ]] || die "unfilled placeholder left in $out"
    (umask 077 && printf '%s\n' "$text" >"$out")
    chmod "$mode" "$out"
}

# --- start each part --------------------------------------------------------------------------------------------

munge_round_trip() { munge -n --socket="$MUNGE_SOCKET" | unmunge --socket="$MUNGE_SOCKET"; }

start_munge() {
    id munge >/dev/null 2>&1 || die "user 'munge' does not exist (the munge package creates it)"
    local key="$DIR/munge/munge.key"
    chown munge: "$DIR/munge"
    chmod 755 "$DIR/munge"
    if command -v mungekey >/dev/null; then
        runuser -u munge -- mungekey --create --keyfile="$key" --force
    else
        dd if=/dev/urandom of="$key" bs=1024 count=1 status=none
    fi
    chown munge: "$key"
    chmod 400 "$key"
    start_daemon munged "$DIR/munge/munged.log" runuser -u munge -- /usr/sbin/munged --key-file="$key" \
        --socket="$MUNGE_SOCKET" --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" \
        --seed-file="$DIR/munge/munged.seed"
    wait_for 10 "munged" "$DIR/munge/munged.log" munge_round_trip
    log "munged up (socket $MUNGE_SOCKET)"
}


start_mariadb() {
    local data="$DIR/mysql/data" logfile="$DIR/mysql/mysqld.log"
    mariadb-install-db --no-defaults --datadir="$data" --user=root --auth-root-authentication-method=socket \
        --skip-test-db >"$DIR/mysql/install-db.log" 2>&1 \
        || { tail -n 20 "$DIR/mysql/install-db.log" >&2; die "mariadb-install-db failed"; }
    # InnoDB sizes are those slurmdbd asks for; durability is traded for speed (a scratch database).
    setsid /usr/sbin/mariadbd --no-defaults --datadir="$data" --user=root --socket="$DB_SOCKET" \
        --port="$DB_PORT" --bind-address=127.0.0.1 --pid-file="$DIR/mysql/mysqld.pid" --log-error="$logfile" \
        --skip-name-resolve --innodb-buffer-pool-size=1024M --innodb-log-file-size=64M \
        --innodb-lock-wait-timeout=900 --innodb-flush-log-at-trx-commit=0 --innodb-doublewrite=0 \
        </dev/null >>"$logfile" 2>&1 9>&- &
    local server_pid=$! i
    for ((i = 0; i < 600; i++)); do
        mariadb-admin --no-defaults --socket="$DB_SOCKET" -u root ping >/dev/null 2>&1 && break
        kill -0 "$server_pid" 2>/dev/null || { tail -n 20 "$logfile" >&2; die "mariadbd exited at start (see $logfile)"; }
        sleep 0.1
    done
    ((i < 600)) || { tail -n 20 "$logfile" >&2; die "MariaDB did not answer within 60 s (see $logfile)"; }
    wait_for 5 "MariaDB pid file" "$logfile" running "$DIR/mysql/mysqld.pid" mariadbd
    DB_PASSWORD="$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
    mariadb --no-defaults --socket="$DB_SOCKET" -u root <<EOF
CREATE DATABASE slurm_acct_db;
CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASSWORD';
CREATE USER 'slurm'@'localhost' IDENTIFIED BY '$DB_PASSWORD';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
EOF
    log "MariaDB up (127.0.0.1:$DB_PORT)"
}

write_slurm_configs() {
    local host mem_total_mb node_mem node_cpus node_lines="" i
    host="$(hostname -s)"
    mem_total_mb="$(awk '/^MemTotal:/ { print int($2 / 1024) }' /proc/meminfo)"
    node_cpus="${NODE_CPUS:-4}"
    node_mem="${NODE_MEM_MB:-$((mem_total_mb / NODES))}"
    require_int NODE_CPUS "$node_cpus"
    require_int NODE_MEM_MB "$node_mem"
    for ((i = 1; i <= NODES; i++)); do
        node_lines+="NodeName=n$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((SLURMD_PORT + i - 1))"
        node_lines+=" CPUs=$node_cpus Boards=1 SocketsPerBoard=1 CoresPerSocket=$node_cpus ThreadsPerCore=1"
        node_lines+=" RealMemory=$node_mem State=UNKNOWN"$'\n'
    done
    # Job ids from the clock: a fresh state folder must not hand out ids an earlier cluster used
    # (submitit keys its files by job id). Slurm caps ids below 67108863.
    local first_job_id=$(($(date +%s) % 60000000 + 1000))
    local common=("DIR=$DIR" "MUNGE_SOCKET=$MUNGE_SOCKET" "DBD_PORT=$DBD_PORT")
    render "$TEMPLATE_DIR/slurm.conf.in" "$DIR/etc/slurm.conf" 644 "${common[@]}" \
        "CLUSTER_NAME=$CLUSTER_NAME" "HOST=$host" "CTLD_PORT=$CTLD_PORT" "CRED_EXPIRE=$CRED_EXPIRE" \
        "FIRST_JOB_ID=$first_job_id" "SLURMD_TIMEOUT=10" "KILL_WAIT=2" "NODE_LINES=${node_lines%$'\n'}"
    render "$TEMPLATE_DIR/slurmdbd.conf.in" "$DIR/etc/slurmdbd.conf" 600 "${common[@]}" \
        "DB_PORT=$DB_PORT" "DB_PASSWORD=$DB_PASSWORD"
}

accounting_works() {
    sacctmgr -n -P show cluster format=cluster 2>/dev/null | grep -qx "$CLUSTER_NAME" \
        && sacct -n -X -a -S now-1minutes -o JobID >/dev/null 2>&1
}

start_slurmdbd() {
    start_daemon slurmdbd "$DIR/log/slurmdbd.log" /usr/sbin/slurmdbd
    wait_for 60 "slurmdbd" "$DIR/log/slurmdbd.log" sacctmgr -n show cluster
    sacctmgr -i -Q add cluster "$CLUSTER_NAME" >/dev/null
    log "slurmdbd up (127.0.0.1:$DBD_PORT), cluster '$CLUSTER_NAME' registered"
}

start_slurmctld() {
    start_daemon slurmctld "$DIR/log/slurmctld.log" /usr/sbin/slurmctld
    wait_for 30 "slurmctld" "$DIR/log/slurmctld.log" scontrol ping
    log "slurmctld up (127.0.0.1:$CTLD_PORT)"
}

start_slurmd() {  # NODE
    start_daemon "slurmd $1" "$DIR/log/slurmd-$1.log" /usr/sbin/slurmd -N "$1"
}

all_nodes_ready() {  # every node answers: idle, mixed or allocated, without a '*' (not responding)
    local states
    states="$(sinfo -h -N -o '%t' 2>/dev/null)" || return 1
    [[ "$(grep -cE '^(idle|mix|alloc)$' <<<"$states")" == "$NODES" ]]
}

write_env_file() {
    {
        printf "export DEV_CLUSTER_DIR='%s'\n" "$DIR"
        printf "export SLURM_CONF='%s'\n" "$SLURM_CONF"
        printf "export DEV_CLUSTER_NODES='%s'\n" "$NODES"
    } >"$DIR/env.sh.tmp"
    mv "$DIR/env.sh.tmp" "$DIR/env.sh"
}

# --- commands ---------------------------------------------------------------------------------------------------

cmd_status() {
    if [[ ! -f "$DIR/env.sh" ]]; then
        log "not up: no cluster in $DIR (run: slurm/dev-cluster.sh up)"
        return 1
    fi
    NODES="$(recorded_nodes)"
    set_node_names
    report_status
}

report_status() {  # for $NODES nodes; exit 0 only when every daemon runs, slurmctld answers and accounting works
    local ok=0 name
    count_core_running
    ((${#DEAD[@]} == 0)) || { log "not running: ${DEAD[*]}"; ok=1; }
    for name in "${NODE_NAMES[@]}"; do
        running "$DIR/run/slurmd-$name.pid" slurmd || { log "not running: slurmd $name"; ok=1; }
    done
    printf 'SLURM_CONF=%s\n' "$SLURM_CONF"
    if scontrol ping >/dev/null 2>&1; then
        sinfo -N -o '%N %P %t %c %m' || ok=1
    else
        log "slurmctld does not answer"
        ok=1
    fi
    if accounting_works; then
        printf 'accounting: ok (slurmdbd, cluster %s)\n' "$CLUSTER_NAME"
    else
        printf 'accounting: NOT working\n'
        ok=1
    fi
    return "$ok"
}

cmd_up() {
    ((EUID == 0)) || die "'up' needs root (it starts munged as user munge, slurmd as root, and edits $HOSTS_FILE)"
    install_packages
    mkdir -p "$DIR"
    exec 9<"$DIR"
    flock -w 300 9 || die "another dev-cluster.sh holds the lock on $DIR"

    count_core_running
    if ((CORE_ALIVE > 0)); then
        ((${#DEAD[@]} == 0)) || die "the cluster in $DIR is partly down (${DEAD[*]} not running); run 'slurm/dev-cluster.sh down' then 'up'"
        [[ -f "$DIR/env.sh" ]] || die "the cluster in $DIR did not finish starting (no env.sh); run 'slurm/dev-cluster.sh down' then 'up'"
        local recorded
        recorded="$(recorded_nodes)"
        if [[ -n "${NODES_REQUESTED:-}" && "$NODES_REQUESTED" != "$recorded" ]]; then
            die "the cluster in $DIR runs $recorded nodes, not NODES=$NODES_REQUESTED; run 'slurm/dev-cluster.sh down' first"
        fi
        NODES="$recorded"
        set_node_names
        add_hosts_entries
        local name restarted=()
        for name in "${NODE_NAMES[@]}"; do
            if ! running "$DIR/run/slurmd-$name.pid" slurmd; then
                start_slurmd "$name"
                restarted+=("$name")
            fi
        done
        if ((${#restarted[@]})); then
            wait_for 30 "all $NODES nodes" "$DIR/log/slurmctld.log" all_nodes_ready
            log "already up; restarted the stopped slurmd of: ${restarted[*]}"
        else
            log "already up; nothing to do"
        fi
        cmd_status >&2 || true
        cat "$DIR/env.sh"
        return 0
    fi

    local started=$SECONDS
    check_ports_free
    prepare_state_dir
    trap stop_after_failed_up EXIT
    trap "exit 130" INT TERM
    add_hosts_entries
    start_munge
    start_mariadb
    write_slurm_configs
    start_slurmdbd
    start_slurmctld
    local name
    for name in "${NODE_NAMES[@]}"; do start_slurmd "$name"; done
    wait_for 30 "all $NODES nodes" "$DIR/log/slurmctld.log" all_nodes_ready
    report_status >&2 || die "cluster started but status reports a problem"
    write_env_file
    trap - EXIT INT TERM
    log "up in $((SECONDS - started)) s: $NODES nodes, partition debug; state in $DIR"
    cat "$DIR/env.sh"
}

cancel_all_jobs() {
    running "$DIR/run/slurmctld.pid" slurmctld || return 0
    local jobs=()
    mapfile -t jobs < <(squeue -h -o '%A' 2>/dev/null)
    ((${#jobs[@]})) || return 0
    log "cancelling jobs: ${jobs[*]}"
    scancel "${jobs[@]}" 2>/dev/null || true
    local i
    for ((i = 0; i < 100; i++)); do
        [[ -z "$(squeue -h -o '%A' 2>/dev/null)" ]] && return 0
        sleep 0.1
    done
}

stop_stray_stepds() {  # slurmstepd processes of this cluster's nodes outlive slurmd; they log into $DIR/log
    local proc pid fd
    for proc in /proc/[0-9]*; do
        pid="${proc#/proc/}"
        pid_is "$pid" slurmstepd || continue
        for fd in "$proc"/fd/*; do
            if [[ "$(readlink "$fd" 2>/dev/null)" == "$DIR/log/"* ]]; then
                stop_pid "$pid" slurmstepd "slurmstepd"
                break
            fi
        done
    done
}

stop_after_failed_up() {
    local rc=$?
    log "'up' failed; stopping what it started (logs stay in $DIR/log, $DIR/mysql, $DIR/munge)"
    stop_everything
    exit "$rc"
}

cmd_restart_controller() {
    [[ -f "$DIR/env.sh" ]] || die "not up: no cluster in $DIR (run: slurm/dev-cluster.sh up)"
    exec 9<"$DIR"
    flock -w 300 9 || die "another dev-cluster.sh holds the lock on $DIR"
    stop_pid_file "$DIR/run/slurmctld.pid" slurmctld slurmctld
    start_slurmctld
}

cmd_down() {
    if [[ ! -d "$DIR" ]]; then
        remove_hosts_entries
        log "nothing to stop: $DIR does not exist"
        return 0
    fi
    exec 9<"$DIR"
    flock -w 300 9 || die "another dev-cluster.sh holds the lock on $DIR"
    stop_everything
    log "down (logs kept in $DIR/log)"
}

stop_everything() {  # by pid file, in reverse start order; the caller holds the lock
    cancel_all_jobs
    local pidfile
    for pidfile in "$DIR"/run/slurmd-*.pid; do
        [[ -e "$pidfile" ]] || continue
        local name="${pidfile##*/slurmd-}"
        stop_pid_file "$pidfile" slurmd "slurmd ${name%.pid}"
    done
    stop_stray_stepds
    local program label lines=()
    mapfile -t lines < <(core_daemons)
    local i
    for ((i = ${#lines[@]} - 1; i >= 0; i--)); do
        read -r pidfile program label <<<"${lines[i]}"
        stop_pid_file "$pidfile" "$program" "$label"
    done
    remove_hosts_entries
    rm -f "$DIR/env.sh"
    running "$DIR/mysql/mysqld.pid" mariadbd || rm -rf "$DIR/mysql/data"  # 100+ MB; `up` starts a fresh one
}

main() {
    local command="${1:-}"
    NODES_REQUESTED="${NODES:-}"
    NODES="${NODES:-2}"
    require_int NODES "$NODES"
    set_node_names
    check_settings
    case "$command" in
        up) cmd_up ;;
        down) cmd_down ;;
        status) cmd_status ;;
        restart-controller) cmd_restart_controller ;;
        -h | --help | help) usage ;;
        *) usage; die "unknown command '${command}'; use up, down, status or restart-controller" ;;
    esac
}

main "$@"
