# Two entry points for a newcomer: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV ?= .venv
REQUIREMENTS ?= requirements-cpu.txt
TORCHREC_VERSION ?= 1.8.0
# the release beside fbgemm-gpu 1.6 (the lent GPUs' stack: benchmarks/gpu/bundle.py), unpacked
# beside the venv for tests/test_oldest_torchrec.py
TORCHREC_OLDEST ?= 1.6.1
BIN := $(VENV)/bin
NPROC ?= 2

.PHONY: venv test test-fast demo dlrm bench data model clean

venv: $(VENV)/.installed $(VENV)/torchrec-$(TORCHREC_OLDEST)

# Re-installs only when the requirements or setup.py change.
$(VENV)/.installed: $(REQUIREMENTS) setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r $(REQUIREMENTS)
	$(BIN)/python -m pip install --quiet --no-deps torchrec==$(TORCHREC_VERSION)
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

$(VENV)/torchrec-$(TORCHREC_OLDEST): $(VENV)/.installed
	$(BIN)/python -m pip download --quiet --no-deps --dest $(VENV)/wheels torchrec==$(TORCHREC_OLDEST)
	$(BIN)/python -m zipfile -e $(VENV)/wheels/torchrec-$(TORCHREC_OLDEST)-*.whl $@
	touch $@

test: venv
	$(BIN)/python -m pytest -q tests

# The unit tier (pytest.ini): no ranks, no timing, nothing slow; under a minute on 2 cores.
test-fast: venv
	$(BIN)/python -m pytest -q -m unit tests

# NeuroShard's, TorchRec's and two heuristics' plans of a held-out task, every device timed here (1-2 min).
demo: venv
	PYTHONWARNINGS=ignore $(BIN)/python examples/compare_plans.py

# DLRM trained under NeuroShard's and TorchRec's plans on 2 gloo ranks, samples/s.
dlrm: venv
	PYTHONWARNINGS=ignore $(BIN)/torchrun --standalone --nproc_per_node $(NPROC) examples/dlrm_torchrun.py --planner neuroshard,torchrec

bench: venv
	$(BIN)/python -m benchmarks.costmodel
	$(BIN)/python -m benchmarks.search_speed
	$(BIN)/python -m benchmarks.compare
	$(BIN)/python -m benchmarks.validate_evaluator

# Re-collect the shipped CPU datasets (resumable: re-run to continue), then re-train.
data: venv
	mkdir -p runs
	for D in 2 4 8; do $(BIN)/neuroshard collect comm --world-size $$D --samples 1200 --out runs/cpu_comm.jsonl; done
	for D in 3 6; do $(BIN)/neuroshard collect comm --world-size $$D --samples 600 --out runs/cpu_comm.jsonl; done
	$(BIN)/neuroshard collect step --kinds input_dist --samples 80 --out runs/cpu_step.jsonl
	$(BIN)/neuroshard collect step --kinds all_reduce reduce_scatter all_gather --samples 60 --out runs/cpu_step.jsonl
	$(BIN)/neuroshard collect step --kinds dp dp_small dp_many --world-sizes 2 3 4 6 8 16 32 64 128 --samples 60 --out runs/cpu_step_dp.jsonl
	$(BIN)/neuroshard collect compute --samples 10000 --out runs/cpu_compute.jsonl
	$(BIN)/neuroshard collect compute --batch-sizes 256 65536 --seed 9 --samples 3000 --out runs/cpu_compute_batch.jsonl
	$(BIN)/neuroshard collect compute --batch-sizes 16384 65536 --seed 10 --samples 300 --out runs/cpu_compute_batch_high.jsonl
	$(BIN)/neuroshard collect compute --precision fp16 --seed 2 --samples 800 --out runs/cpu_compute_fp16.jsonl
	$(BIN)/neuroshard collect compute --pooling none --seed 3 --samples 800 --out runs/cpu_compute_sequence.jsonl
	$(BIN)/neuroshard collect devices --samples 400 --out runs/cpu_compute_devices.jsonl
	for F in cpu_compute cpu_compute_batch cpu_compute_batch_high cpu_compute_fp16 cpu_compute_sequence cpu_compute_devices; do gzip -9 -c runs/$$F.jsonl > torchrec_neuroshard/lab/data/$$F.jsonl.gz; done
	gzip -9 -c runs/cpu_comm.jsonl > torchrec_neuroshard/lab/data/cpu_comm.jsonl.gz
	gzip -9 -c runs/cpu_step.jsonl > torchrec_neuroshard/lab/data/cpu_step.jsonl.gz
	gzip -9 -c runs/cpu_step_dp.jsonl > torchrec_neuroshard/lab/data/cpu_step_dp.jsonl.gz

# The shipped models (pooled, fp16 and sequence kernels where measured; cpu.pt's net at batch
# 4,096, its batch shift learned on the batch-varied files); the older collections did not
# record the CPU's name or cores.
model: venv
	$(BIN)/neuroshard pretrain --data torchrec_neuroshard/lab/data/cpu_compute.jsonl.gz \
		torchrec_neuroshard/lab/data/cpu_compute_fp16.jsonl.gz torchrec_neuroshard/lab/data/cpu_compute_sequence.jsonl.gz \
		torchrec_neuroshard/lab/data/cpu_comm.jsonl.gz torchrec_neuroshard/lab/data/cpu_step.jsonl.gz \
		torchrec_neuroshard/lab/data/cpu_step_dp.jsonl.gz --device-name "AMD EPYC" --cores 2 \
		--batch-shift-data torchrec_neuroshard/lab/data/cpu_compute_batch.jsonl.gz \
		torchrec_neuroshard/lab/data/cpu_compute_batch_high.jsonl.gz \
		--out torchrec_neuroshard/pretrained/cpu.pt
	$(BIN)/neuroshard pretrain --data torchrec_neuroshard/lab/data/intel_xeon_compute.jsonl.gz \
		torchrec_neuroshard/lab/data/intel_xeon_comm_d2.jsonl.gz --cores 2 \
		--out torchrec_neuroshard/pretrained/intel_xeon.pt
	$(BIN)/python -m torchrec_neuroshard.lab.refit_steps --model torchrec_neuroshard/pretrained/intel_xeon.pt \
		--data torchrec_neuroshard/lab/data/intel_xeon_step_dp.jsonl.gz --out torchrec_neuroshard/pretrained/intel_xeon.pt
	$(BIN)/neuroshard pretrain --data torchrec_neuroshard/lab/data/h200_compute.jsonl.gz \
		torchrec_neuroshard/lab/data/h200_compute_seed5.jsonl.gz torchrec_neuroshard/lab/data/h200_compute_fp16.jsonl.gz \
		torchrec_neuroshard/lab/data/h200_compute_sequence.jsonl.gz \
		--out torchrec_neuroshard/pretrained/h200.pt
	$(BIN)/python -m torchrec_neuroshard.lab.refit_steps --model torchrec_neuroshard/pretrained/h200.pt \
		--data torchrec_neuroshard/lab/data/h200_step.jsonl.gz --out torchrec_neuroshard/pretrained/h200.pt

clean:
	rm -rf $(VENV) *.egg-info
