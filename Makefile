# `make test` is the project's test command: gofmt check, go vet, then the full test suite with the race detector.
# Tests need PostgreSQL: the server binaries (apt-get install postgresql) or OUTBOX_TEST_DSN; see internal/pgtest.

GO ?= go

.PHONY: test fmt-check vet bench example

# The steps run strictly in this order (also under make -j).
test:
	@$(MAKE) --no-print-directory fmt-check
	$(GO) vet ./...
	$(GO) test -race -count=1 -timeout 20m ./...

fmt-check:
	@unformatted="$$(find . \( -path ./vendor -o -path ./.git \) -prune -o -name '*.go' -print0 | xargs -0 -r gofmt -l)"; \
	if [ -n "$$unformatted" ]; then \
		echo "gofmt: these files are not formatted (run gofmt -w on them):"; \
		echo "$$unformatted"; \
		exit 1; \
	fi

vet:
	$(GO) vet ./...

bench:
	$(GO) test -run '^$$' -bench . -benchtime 2s ./...

example:
	$(GO) run ./examples/minimal
