#!/usr/bin/env bash
# `slim.sh on`: untrack (index only, files stay) and ignore the embedded weights and bench_results,
# so that a device call's tree (~18 MB) leaves room for a 42 MB part under the 64 MiB limit.
# `slim.sh off`: restore the index and the ignore file. Never commit between the two.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
paths=(gmlx/weights/default_model bench_results)
case "${1:-}" in
  on) git rm -r -q --cached "${paths[@]}"
      for p in "${paths[@]}"; do echo "/$p/" >> .git/info/exclude; done
      echo "tree now $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes" ;;
  off) git reset -q -- "${paths[@]}"
       for p in "${paths[@]}"; do sed -i "\#^/$p/\$#d" .git/info/exclude; done
       git status --short | head ;;
  *) echo "usage: slim.sh on|off"; exit 2 ;;
esac
