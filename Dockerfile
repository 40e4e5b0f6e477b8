# syntax=docker/dockerfile:1
# The statehouse gateway: a locked release build, then a small non-root runtime.

FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
# Manifests first, so dependency builds are cached across source changes.
COPY Cargo.toml Cargo.lock ./
COPY src src
# Cargo.toml names the test and bench targets; their sources must exist to build.
COPY tests tests
COPY bench bench
RUN cargo build --release --locked --bin statehouse

# glibc and CA certificates, no shell, runs as uid 65532 ("nonroot").
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/statehouse /usr/local/bin/statehouse
USER nonroot
# Reachable from outside the container, so `serve` needs tokens
# (STATEHOUSE_TOKENS_FILE) or STATEHOUSE_ALLOW_UNAUTHENTICATED=true: without
# either it exits 2 naming both.
ENV STATEHOUSE_LISTEN=0.0.0.0:8080 \
    STATEHOUSE_LOG_FORMAT=json
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=5s --start-period=40s --retries=3 \
    CMD ["/usr/local/bin/statehouse", "healthcheck"]
ENTRYPOINT ["/usr/local/bin/statehouse"]
CMD ["serve"]
