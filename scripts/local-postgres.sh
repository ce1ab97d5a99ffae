#!/usr/bin/env bash
# A throwaway PostgreSQL cluster of Debian's server on loopback, for the fleet's tests, its
# benchmark and the README's fleet run (as the postgres user when run as root: the server refuses root).
#   scripts/local-postgres.sh start FOLDER PORT   prints the server's URL (add /DATABASE)
#   scripts/local-postgres.sh stop FOLDER
set -euo pipefail
bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
[[ -n "$bin" ]] || { echo "PostgreSQL's server is not installed: run make setup (Debian's postgresql)" >&2; exit 1; }
as_server=(); [[ $(id -u) -eq 0 ]] && as_server=(runuser -u postgres --)
case "${1:-}" in
start)
    folder=$(realpath -m "$2"); port=$3
    mkdir -p "$folder"
    [[ $(id -u) -eq 0 ]] && chown postgres:postgres "$folder"
    [[ -f "$folder/data/PG_VERSION" ]] || "${as_server[@]}" "$bin/initdb" -D "$folder/data" -A trust -U postgres >/dev/null
    "${as_server[@]}" "$bin/pg_ctl" -D "$folder/data" -l "$folder/server.log" -w \
        -o "-h 127.0.0.1 -p $port -k $folder -c max_connections=200" start >/dev/null
    echo "postgresql://postgres@127.0.0.1:$port"
    ;;
stop)
    "${as_server[@]}" "$bin/pg_ctl" -D "$(realpath -m "$2")/data" -m fast stop >/dev/null
    ;;
*)
    echo "usage: $0 start FOLDER PORT | stop FOLDER" >&2; exit 2
    ;;
esac
