#!/bin/bash
# end-to-end check of the launcher workaround (+ -frandom-seed) in both trees
cd /tmp/fattn-repro
R=ggml/src/ggml-cuda/template-instances
export LAUNCH=/tmp/fattn-repro/launch_det.sh
for I in dkq40-dv40 dkq72-dv72; do
  ./compile.sh /tmp/fattn-repro/a $I det -frandom-seed=$R/fattn-tile-instance-$I.cu > log_det_a_$I.txt 2>&1 &
  ./compile.sh /tmp/fattn-repro/b/elsewhere $I det -frandom-seed=$R/fattn-tile-instance-$I.cu > log_det_b_$I.txt 2>&1 &
  wait
done
echo done > det_done
