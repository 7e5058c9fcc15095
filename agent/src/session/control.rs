//! The daemon's session control endpoint: a small HTTP/1.1 JSON API that
//! `tokentrace record --remote` talks to (hyper, like the Prometheus
//! endpoint).
//!
//! - `POST /v1/sessions` with a [`SessionRequest`] starts a session
//!   (201 + its status; 409 when the profiler is busy or too many run);
//! - `GET /v1/sessions` lists them, `GET /v1/sessions/{id}` polls one;
//! - `POST /v1/sessions/{id}/stop` (or `DELETE /v1/sessions/{id}`) ends
//!   one early; it still renders its artifacts;
//! - `GET /v1/sessions/{id}/artifacts/{name}` downloads a finished one's
//!   artifact (only the names in [`super::ARTIFACTS`]).
//!
//! Bound to localhost by default. With `--control-token-file` every request
//! needs `Authorization: Bearer <token>`; bind beyond localhost only with a
//! token (the agent warns otherwise).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde::Serialize;
use tokio::net::TcpListener;

use super::hub::{HubSettings, SessionHub, SessionRequest};
use super::{artifact_path, content_type};
use crate::config::Config;

/// Where the endpoint listens unless told otherwise.
pub const DEFAULT_ADDR: &str = "127.0.0.1:9465";
/// Where daemon sessions write unless told otherwise.
pub const DEFAULT_SESSION_DIR: &str = "/var/lib/tokentrace/sessions";
/// Longest session the endpoint accepts.
pub const MAX_DURATION: Duration = Duration::from_secs(3600);
/// Largest request body read (a session request is a few hundred bytes).
const MAX_BODY_BYTES: usize = 64 * 1024;
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Control endpoint flags of `tokentrace run`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ControlArgs {
    /// Serve the session control API here, for `tokentrace record --remote`
    /// [default: 127.0.0.1:9465; port 0 picks a free one].
    #[arg(long, env = "TOKENTRACE_CONTROL_ADDR")]
    pub control_addr: Option<SocketAddr>,

    /// Do not serve the session control API.
    #[arg(long, conflicts_with = "control_addr")]
    pub no_control: bool,

    /// Require `Authorization: Bearer <token>` on the control API; the
    /// token is this file's content (trimmed).
    #[arg(long, env = "TOKENTRACE_CONTROL_TOKEN_FILE")]
    pub control_token_file: Option<PathBuf>,

    /// Directory for the artifacts of remotely started sessions
    /// [default: /var/lib/tokentrace/sessions].
    #[arg(long, env = "TOKENTRACE_SESSION_DIR")]
    pub session_dir: Option<PathBuf>,

    /// Let remote sessions write raw.pb, which holds captured payload bytes.
    #[arg(long)]
    pub control_allow_raw: bool,
}

impl ControlArgs {
    pub fn session_dir(&self) -> PathBuf {
        self.session_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_SESSION_DIR))
    }
}

/// A running endpoint; dropping it stops serving.
#[derive(Debug)]
pub struct ControlServer {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Reads the bearer token file.
fn read_token(path: &std::path::Path) -> Result<String> {
    let token = std::fs::read_to_string(path)
        .with_context(|| format!("--control-token-file {}", path.display()))?
        .trim()
        .to_string();
    if token.is_empty() {
        bail!("--control-token-file {} is empty", path.display());
    }
    Ok(token)
}

/// Starts the endpoint as `args` say. An explicit `--control-addr` that
/// cannot be bound is an error; the default address being taken (another
/// agent on this host) is only a warning.
pub async fn start(args: &ControlArgs, hub: SessionHub) -> Result<Option<ControlServer>> {
    if args.no_control {
        return Ok(None);
    }
    let token = args
        .control_token_file
        .as_deref()
        .map(read_token)
        .transpose()?;
    let (addr, explicit) = match args.control_addr {
        Some(addr) => (addr, true),
        None => (
            DEFAULT_ADDR
                .parse()
                .context("the default control address")?,
            false,
        ),
    };
    let listener = match TcpListener::bind(addr).await {
        Ok(listener) => listener,
        Err(err) if !explicit => {
            tracing::warn!(
                "control endpoint: {addr} is taken ({err}); remote sessions are off (use --control-addr)"
            );
            return Ok(None);
        }
        Err(err) => {
            return Err(err).with_context(|| format!("--control-addr {addr}: cannot listen"))
        }
    };
    let addr = listener.local_addr().context("control endpoint address")?;
    if token.is_none() && !addr.ip().is_loopback() {
        tracing::warn!(
            "control endpoint on {addr} without --control-token-file: anyone who can reach it can start sessions"
        );
    }
    eprintln!("tokentrace: control endpoint at http://{addr}");
    let state = Arc::new(State { hub, token });
    let task = tokio::spawn(serve(listener, state));
    Ok(Some(ControlServer { addr, task }))
}

/// The hub and endpoint of `tokentrace run`: both `None` with
/// `--no-control` or when the default address is taken.
pub async fn for_run(
    args: &ControlArgs,
    config: &Config,
) -> Result<(Option<SessionHub>, Option<ControlServer>)> {
    if args.no_control {
        return Ok((None, None));
    }
    let hub = SessionHub::new(HubSettings {
        stitch: config.stitch.stitcher_config(),
        idle_timeout: config.stitch.idle_timeout,
        explain: config.explain.clone(),
        sessions_dir: args.session_dir(),
        allow_raw: args.control_allow_raw,
        max_duration: Some(MAX_DURATION),
    });
    Ok(match start(args, hub.clone()).await? {
        Some(server) => (Some(hub), Some(server)),
        None => (None, None),
    })
}

struct State {
    hub: SessionHub,
    token: Option<String>,
}

/// Compares in time independent of where the strings differ.
fn same_token(given: &[u8], expected: &[u8]) -> bool {
    if given.len() != expected.len() {
        return false;
    }
    given
        .iter()
        .zip(expected)
        .fold(0u8, |acc, (a, b)| acc | (a ^ b))
        == 0
}

fn authorized(req: &Request<Incoming>, token: Option<&str>) -> bool {
    let Some(token) = token else { return true };
    req.headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|given| same_token(given.trim().as_bytes(), token.as_bytes()))
}

type Reply = Response<Full<Bytes>>;

fn reply(status: StatusCode, content_type: &'static str, body: Bytes) -> Reply {
    let mut response = Response::new(Full::new(body));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

fn json(status: StatusCode, value: &impl Serialize) -> Reply {
    match serde_json::to_vec(value) {
        Ok(body) => reply(status, "application/json", Bytes::from(body)),
        Err(err) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!("encoding the reply: {err}"),
        ),
    }
}

fn error(status: StatusCode, message: &str) -> Reply {
    let body = serde_json::json!({ "error": message });
    reply(
        status,
        "application/json",
        Bytes::from(body.to_string().into_bytes()),
    )
}

async fn start_session(req: Request<Incoming>, hub: &SessionHub) -> Reply {
    let body = match Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(body) => body.to_bytes(),
        Err(err) => {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("reading the request body (at most {MAX_BODY_BYTES} bytes): {err}"),
            )
        }
    };
    let request: SessionRequest = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(err) => {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("a session request is JSON like {{\"selector\":{{\"pid\":[123]}},\"duration\":\"30s\"}}: {err}"),
            )
        }
    };
    match hub.start(request, None) {
        Ok(status) => {
            tracing::info!("session {} started ({})", status.id, status.selector);
            json(StatusCode::CREATED, &status)
        }
        Err(err) => error(
            StatusCode::from_u16(err.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            &err.to_string(),
        ),
    }
}

async fn artifact(hub: &SessionHub, id: &str, name: &str) -> Reply {
    let Some(status) = hub.status(id) else {
        return error(StatusCode::NOT_FOUND, &format!("no session {id}"));
    };
    let Some(dir) = hub.artifacts_dir(id) else {
        return error(
            StatusCode::CONFLICT,
            &format!(
                "session {id} is {:?}: artifacts exist once it is done",
                status.state
            ),
        );
    };
    let Some(path) = artifact_path(&dir, name) else {
        return error(
            StatusCode::NOT_FOUND,
            &format!("no artifact named {name:?}"),
        );
    };
    let read = tokio::task::spawn_blocking(move || std::fs::read(path)).await;
    match read.unwrap_or_else(|err| Err(std::io::Error::other(err))) {
        Ok(bytes) => reply(StatusCode::OK, content_type(name), Bytes::from(bytes)),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => error(
            StatusCode::NOT_FOUND,
            &format!("session {id} has no {name}"),
        ),
        Err(err) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!("reading {name}: {err}"),
        ),
    }
}

async fn handle(req: Request<Incoming>, state: &State) -> Reply {
    if !authorized(&req, state.token.as_deref()) {
        let mut response = error(
            StatusCode::UNAUTHORIZED,
            "this endpoint needs Authorization: Bearer <token> (record --remote reads TOKENTRACE_CONTROL_TOKEN or --token-file)",
        );
        response
            .headers_mut()
            .insert("www-authenticate", HeaderValue::from_static("Bearer"));
        return response;
    }
    let hub = &state.hub;
    let path = req.uri().path().trim_end_matches('/').to_string();
    let parts: Vec<&str> = path.split('/').skip(1).collect();
    match (req.method().clone(), parts.as_slice()) {
        (Method::GET, ["v1", "sessions"]) => json(StatusCode::OK, &hub.list()),
        (Method::POST, ["v1", "sessions"]) => start_session(req, hub).await,
        (Method::GET, ["v1", "sessions", id]) => match hub.status(id) {
            Some(status) => json(StatusCode::OK, &status),
            None => error(StatusCode::NOT_FOUND, &format!("no session {id}")),
        },
        (Method::POST, ["v1", "sessions", id, "stop"])
        | (Method::DELETE, ["v1", "sessions", id]) => {
            if hub.stop(id) {
                json(StatusCode::ACCEPTED, &hub.status(id))
            } else {
                error(StatusCode::NOT_FOUND, &format!("no session {id}"))
            }
        }
        (Method::GET, ["v1", "sessions", id, "artifacts", name]) => artifact(hub, id, name).await,
        (Method::GET, [] | ["v1"]) => json(
            StatusCode::OK,
            &serde_json::json!({
                "service": "tokentrace session control",
                "version": env!("CARGO_PKG_VERSION"),
                "sessions": "/v1/sessions",
            }),
        ),
        _ => error(
            StatusCode::NOT_FOUND,
            "not found (the API is under /v1/sessions)",
        ),
    }
}

async fn serve(listener: TcpListener, state: Arc<State>) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(err) => {
                tracing::warn!("control endpoint: accept failed: {err}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let state = Arc::clone(&state);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let state = Arc::clone(&state);
                async move { Ok::<_, Infallible>(handle(req, &state).await) }
            });
            let served = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service)
                .await;
            if let Err(err) = served {
                tracing::debug!("control endpoint: connection ended: {err}");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_whole() {
        assert!(same_token(b"secret", b"secret"));
        assert!(!same_token(b"secreT", b"secret"));
        assert!(!same_token(b"secret1", b"secret"));
        assert!(!same_token(b"", b"secret"));
    }

    #[test]
    fn token_files_are_trimmed_and_must_not_be_empty() {
        let path = std::env::temp_dir().join(format!("tt-token-{}", std::process::id()));
        std::fs::write(&path, "s3cret\n").expect("write");
        assert_eq!(read_token(&path).expect("token"), "s3cret");
        std::fs::write(&path, "\n").expect("write");
        assert!(read_token(&path).is_err());
        let _ = std::fs::remove_file(&path);
    }
}
