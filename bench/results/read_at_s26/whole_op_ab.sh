#!/bin/bash
# alternate old (HEAD) and new (working tree) mpccs-perf, in place and out of place
cd /tmp
B=/work/main/.venv/bin
for r in 1 2 3 4 5 6; do
  for arm in old new; do
    if [ $arm = old ]; then P=/tmp/wt_head; else P=/work/main; fi
    for mode in "" "--in-place"; do
      PYTHONPATH=$P OMP_NUM_THREADS=1 $B/mpccs-run -n 2 --no-prefix $B/mpccs-perf all_reduce -b 4M -e 8M -f 2 -n 30 -w 5 $mode 2>&1 \
        | awk -v arm=$arm -v mode="${mode:-oop}" '/# code:/ {code=$0} /^ +[0-9]/ {print arm, mode, $1, $8} END {print arm, mode, code > "/dev/stderr"}'
    done
  done
done
