# `make test` is the project's test command: gofmt check, go vet, then the full test suite with the race detector.
# Tests need PostgreSQL: the server binaries (apt-get install postgresql) or OUTBOX_TEST_DSN; see internal/pgtest.
# The end-to-end tests in e2e/ (its own module) also need rabbitmq-server and redis-server
# (apt-get install rabbitmq-server redis-server); they start their own servers on loopback. Kafka
# is franz-go's kfake (no Kafka server package installs here), built by the tests from
# internal/kfakeserver, its own module outside the workspace: kfake requires Go 1.26, above the
# floor of every other module.
# Modules: the library (this directory) requires only what its packages import, plus what its
# own tests need that is light (watermill-sql, goleak); tests that need NATS, pgx, SQLite, an
# OpenTelemetry SDK or a broker client live in e2e/, the example (and its sqlx, GORM and bun consumers,
# examples/order-processing/orm) in examples/order-processing/,
# the benchmark in bench/, the pgx driver in drivers/outboxpgx/, the MySQL driver in
# drivers/mysql/ (its tests need MariaDB's server binaries: apt-get install mariadb-server), each
# its own module. They require
# each other at the release version and go.work (at the root) ties them to this tree; `go mod tidy`
# in one of them: make tidy. scripts/depcheck.sh (run by make test) keeps the library light and
# installs it, and the pgx form, into a throwaway module from a file-system module proxy, with no
# replace; scripts/release.sh tags the modules together (docs/releasing.md).

GO ?= go

.PHONY: test fmt-check vet bench example alerts-test model model-full tidy

# The Go code of README and docs/ is type-checked against the packages (internal/cmd/docsnippets),
# and so is the code in these package comments (what go doc and pkg.go.dev show first).
DOC_COMMENTS := doc.go console/console.go drivers/outboxpgx/outboxpgx.go drivers/mysql/doc.go drivers/sqlite/doc.go outboxtest/outboxtest.go

# The steps run strictly in this order (also under make -j).
test:
	@$(MAKE) --no-print-directory fmt-check
	@$(MAKE) --no-print-directory alerts-test
	$(GO) vet ./...
	cd examples/order-processing && $(GO) vet ./...
	cd e2e && $(GO) vet ./...
	cd bench && $(GO) vet ./...
	cd drivers/outboxpgx && $(GO) vet ./...
	cd internal/kfakeserver && GOWORK=off $(GO) vet ./...
	cd drivers/mysql && $(GO) vet ./...
	GO=$(GO) ./scripts/depcheck.sh
	@$(MAKE) --no-print-directory model
	GO=$(GO) ./scripts/release.sh --dry-run v0.99.0-dryrun
	$(GO) run ./internal/cmd/docsnippets README.md docs/*.md $(DOC_COMMENTS)
	$(GO) test -race -count=1 -timeout 20m ./...
	cd drivers/outboxpgx && $(GO) test -race -count=1 -timeout 15m ./...
	cd drivers/mysql && $(GO) test -race -count=1 -timeout 10m ./...
	cd examples/order-processing && $(GO) test -race -count=1 -timeout 10m ./...
	@$(MAKE) --no-print-directory e2e E2E_FLAGS=
	@$(MAKE) --no-print-directory test-oldest

# The go directive says 1.25: vet every module (which type-checks every test as well) with the
# oldest Go it allows (the toolchain comes from the Go module proxy, like any module), beside the
# newest installed one above, and run on it what exercises the library end to end: the runnable
# examples, the crash matrices and 4 runs of the fault campaign (that they build and hold on this
# Go). The whole suite runs once, under the race detector, above: run again here it took eight
# minutes of every CI run, a quarter of it, to repeat the same schedules on the same code.
OLDEST_CAMPAIGN_RUNS ?= 4
OLDEST_RUN ?= ^(Example.*|TestFaultCampaign|TestCrashMatrix.*|TestCrashAtEveryStep)$$
OLDEST_GO ?= go1.25.0
.PHONY: test-oldest
# go.work says what the newest module needs (bench's go line); the oldest Go gets a workspace
# without bench, written beside go.work so that its relative paths hold.
OLDEST_WORK := $(CURDIR)/.oldest.work
test-oldest:
	GOTOOLCHAIN=$(OLDEST_GO) $(GO) version
	cp go.work $(OLDEST_WORK) && cp go.work.sum $(OLDEST_WORK).sum
	GOWORK=$(OLDEST_WORK) $(GO) work edit -go=$(patsubst go%,%,$(OLDEST_GO)) -dropuse=./bench
	GOWORK=$(OLDEST_WORK) GOTOOLCHAIN=$(OLDEST_GO) $(GO) vet ./...
	cd e2e && GOWORK=$(OLDEST_WORK) GOTOOLCHAIN=$(OLDEST_GO) $(GO) vet ./...
	cd examples/order-processing && GOWORK=$(OLDEST_WORK) GOTOOLCHAIN=$(OLDEST_GO) $(GO) vet ./...
	cd drivers/outboxpgx && GOWORK=$(OLDEST_WORK) GOTOOLCHAIN=$(OLDEST_GO) $(GO) vet ./...
	cd drivers/mysql && GOWORK=$(OLDEST_WORK) GOTOOLCHAIN=$(OLDEST_GO) $(GO) vet ./...
	GOWORK=$(OLDEST_WORK) GOTOOLCHAIN=$(OLDEST_GO) OUTBOX_GO="$$(command -v $(GO))" OUTBOX_CAMPAIGN_RUNS=$(OLDEST_CAMPAIGN_RUNS) \
		$(GO) test -count=1 -timeout 20m -run '$(OLDEST_RUN)' ./...

# The end-to-end tests on real brokers. The TestRabbitMQ... tests run without the race detector:
# watermill-amqp v3.0.2 itself races on a reconnect (ConnectionWrapper.connected is replaced
# without synchronisation; see docs/brokers.md), which -race reports on every broker restart.
# Every other test here, and the library in the root module, run under -race; TestKafka and
# TestKafkaOrderPerKey (watermill-kafka v3.0.6, Sarama v1.43.3) among them: no race was reported
# through their consumer kills and broker restarts.
E2E_FLAGS ?= -v
.PHONY: e2e
e2e:
	cd e2e && $(GO) test -race -count=1 -timeout 10m $(E2E_FLAGS) -skip '^TestRabbitMQ' ./...
	cd e2e && $(GO) test -count=1 -timeout 10m $(E2E_FLAGS) -run '^TestRabbitMQ' ./...

# The protocol's model (model/outbox.pml, docs/protocol.md), checked with SPIN (apt-get install spin):
# the protocol as fixed keeps every invariant, and each old variant is caught breaking its own.
# `model` uses the quick bounds (about three minutes on 2 cores, part of make test); `model-full`
# larger ones (up to 10 GB of memory, ten minutes).
model:
	./model/check.sh quick

model-full:
	./model/check.sh full

fmt-check:
	@unformatted="$$(find . \( -path ./vendor -o -path ./.git \) -prune -o -name '*.go' -print0 | xargs -0 -r gofmt -l)"; \
	if [ -n "$$unformatted" ]; then \
		echo "gofmt: these files are not formatted (run gofmt -w on them):"; \
		echo "$$unformatted"; \
		exit 1; \
	fi

vet:
	$(GO) vet ./...

# The shipped alert rules and their unit tests (deploy/prometheus/outbox-alerts_test.yaml). promtool
# comes with Prometheus (Debian: apt-get install prometheus; .ci/run does). Missing, it is an error:
# rules that were not tested are not known to fire.
PROMTOOL ?= promtool
alerts-test:
	@command -v $(PROMTOOL) >/dev/null || { echo "alerts-test: $(PROMTOOL) not found: install Prometheus (apt-get install prometheus) or set PROMTOOL=/path/to/promtool" >&2; exit 1; }
	cd deploy/prometheus && $(PROMTOOL) check rules outbox-alerts.yaml
	cd deploy/prometheus && $(PROMTOOL) test rules outbox-alerts_test.yaml

# go mod tidy in every module. Outside the workspace (GOWORK=off) a module that requires the
# library at a version not yet on the module proxy (the next release) cannot resolve it, so the
# library's modules come from a file-system proxy made of this tree; their go.sum lines are then
# left out again, since inside the workspace the tree stands in for them.
tidy:
	GO=$(GO) ./scripts/tidy.sh

bench:
	$(GO) test -run '^$$' -bench . -benchtime 2s ./...

example:
	$(GO) run ./examples/minimal

# Benchmarks: the cost of exactly-once side by side with the alternatives (docs/benchmarks.md).
# bench/ is its own module, so that River and rbaliyan/event never enter the library's go.mod.
# It starts its own PostgreSQL (or uses OUTBOX_BENCH_DSN) and an in-process NATS JetStream, and
# rewrites docs/benchmarks.md (between its markers) and docs/benchmarks.svg.
# Issue 46's targets for many tenants in one run (about 45 minutes; docs/scaling.md): 200 idle
# tenants as schemas of one pool and as databases (pools keeping no idle connection) side by
# side, at steady state (a 10-minute window, which holds a round of every member's cleanup,
# 1000 s after the start); then 50 msg/s over 200 tenant databases against one, interleaved
# rounds, p99 and cost per message (and what a message adds from 50 to 100 msg/s), saturating
# rounds; then one of ten tenant databases down for 15 s.
.PHONY: bench-tenants
bench-tenants:
	OUTBOX_IDLE_COST=200 OUTBOX_IDLE_LAYOUTS=schemas,dbs OUTBOX_IDLE_POOL_IDLE=0 OUTBOX_IDLE_SET_ONLY=1 \
	OUTBOX_IDLE_ROUNDS=1 OUTBOX_IDLE_WARMUP=1000 OUTBOX_IDLE_WINDOW=600 \
	OUTBOX_TENANT_LATENCY=200 OUTBOX_TENANT_SLOPE=100 OUTBOX_TENANT_SATURATE=20 OUTBOX_TENANT_DOWN=15 \
		$(GO) test -count=1 -run '^(TestIdleCost|TestTenantLatency)$$' -v -timeout 90m ./tenant/

.PHONY: bench-quick bench-full

bench-quick: # reduced sizes, under 2 minutes
	cd bench && $(GO) run . -mode quick

bench-full: # the full sizes (10M retained IDs, 1M expired rows)
	cd bench && $(GO) run . -mode full

# The relay drain: a 30,000-effect backlog drained by one and three relays, beside Watermill's
# forwarder and River; the consumers' latency during a drain; the rate with 10M rows in the tables.
.PHONY: bench-drain-quick bench-drain-full

bench-drain-quick: # 200k rows in the scale run, about 2 minutes
	cd bench && $(GO) run . -drain -mode quick

bench-drain-full: # 10M rows in the scale run
	cd bench && $(GO) run . -drain -mode full

# Scaling: 1, 2, 4 and 8 consumer processes (and 4 Outboxes per process) against one PostgreSQL:
# throughput, server CPU and WAL per message; rewrites the generated part of docs/scaling.md.
.PHONY: bench-scaling

bench-scaling: # 3000 messages per step, 2-3 minutes
	cd bench && $(GO) run . -scaling -mode quick

# The example order service (examples/order-processing, its own module): SQLite and an in-process
# NATS JetStream, nothing to set up. `make chaos` places N orders (default 1000) under duplicated
# deliveries, failing handlers and crashing consumers, and reconciles; add ARGS='-postgres DSN',
# ARGS='-postgres DSN -broker amqp -amqp-url URL' and the like.
.PHONY: demo chaos alerts-live

demo:
	cd examples/order-processing && $(GO) run . $(ARGS)

chaos:
	cd examples/order-processing && $(GO) run . -chaos -orders $(or $(N),1000) $(ARGS)

# The shipped alert rules under a real Prometheus: the chaos run of the example, then the service
# killed (SIGKILL), Prometheus evaluating for 3 minutes more; prints which alerts fired and when
# (docs/observability.md has the last result). Needs the prometheus binary (apt-get install
# prometheus). ARGS='-orders 1000 -watch 5m -chaos-args "-fail-rate 0.3"' and the like.
alerts-live:
	cd examples/order-processing && $(GO) run ./alertslive $(ARGS)

# The failover tests (e2e/failover) alone: a primary and a streaming standby, the primary killed
# and the standby promoted. make e2e (and so make test) runs them with the rest.
.PHONY: failover
failover:
	cd e2e && $(GO) test -race -count=1 -timeout 15m -v ./failover/
