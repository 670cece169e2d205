# Prototype A/B (this branch only): the any-gate preps split by chunk against main, on one GPU.
# Prepare on a CPU machine (Triton 3.6), from the repository root of this branch:
#   for t in old new: a tree (.scratch/ab/$t: dplr_gen, benchmarks, scripts, generated/__init__.py, pyproject.toml;
#   old from main, new from this branch) whose specs/hopper.yaml is this branch's spec with variants reduced to
#     - {ops: [chunk], dtypes: [bf16], head_dims: [64, 128], chunk_sizes: [16], varlen: [false],
#        gate_bounds: [-0.61, null], gate_dtype: same}
#   (old: without split_exact), built with DPLR_GEN_CACHE_DIR=<cache> dplr-gen build specs/hopper.yaml, packed with
#   dplr-gen pack specs/hopper.yaml -o .gpucarry/ab_$t.tar.gz (about 2.5 MB each).
# Run (carry .whl .scratch/ab .gpucarry/ab_old.tar.gz .gpucarry/ab_new.tar.gz): bash scripts/ab_split_preps.sh
. scripts/gpu_setup.sh > /dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
ROOT=$PWD
for t in old new; do
  (cd .scratch/ab/$t && python3 -m dplr_gen.cli unpack $ROOT/.gpucarry/ab_$t.tar.gz && python3 -m dplr_gen.cli build specs/hopper.yaml -j 16 2>&1 | tail -1)
done
for r in 1 2; do for t in old new; do
  [ $r = 2 ] && C=dense8x4096x64 || C=dense8x4096x64,dense4x4096,dense8x2048x16x128
  (cd .scratch/ab/$t && timeout 100 python3 scripts/kernel_profile.py --cases $C \
     --package generated/hopper --bounds=-0.61,none > $OUT/kp_${t}_$r.log 2>&1; cp $OUT/kernel_profile_hopper.json $OUT/kp_${t}_$r.json)
  echo "== $t $r"; grep "lower_bound" $OUT/kp_${t}_$r.log; grep "prep" $OUT/kp_${t}_$r.log
done; done
rm -f $OUT/kernel_profile_hopper.json
(cd .scratch/ab/new && timeout 90 python3 scripts/gpu_check.py --only gates:mixed-D64,gates:mixed-D128 2>&1 | tail -12)
