#!/bin/bash
# same logical path via symlink W -> tree; launcher + seed. Also re-run tree a (run-to-run check of launcher).
cd /tmp/fattn-repro
R=ggml/src/ggml-cuda/template-instances; I=dkq40-dv40
export LAUNCH=/tmp/fattn-repro/launch_det.sh
ln -sfn /tmp/fattn-repro/a W
./compile.sh /tmp/fattn-repro/W $I sym -frandom-seed=$R/fattn-tile-instance-$I.cu > log_sym_a.txt 2>&1 &
./compile.sh /tmp/fattn-repro/a $I det -frandom-seed=$R/fattn-tile-instance-$I.cu > log_det_a_${I}_run2.txt 2>&1 &
wait
cp W/build/sym/fattn-tile-instance-$I.cu.o saved/sym_a40.o
ln -sfn /tmp/fattn-repro/b/elsewhere W
./compile.sh /tmp/fattn-repro/W $I sym -frandom-seed=$R/fattn-tile-instance-$I.cu > log_sym_b.txt 2>&1 &
./compile.sh /tmp/fattn-repro/b/elsewhere $I det -frandom-seed=$R/fattn-tile-instance-$I.cu > log_det_b_${I}_run2.txt 2>&1 &
wait
cp W/build/sym/fattn-tile-instance-$I.cu.o saved/sym_b40.o
echo done > sym_done
