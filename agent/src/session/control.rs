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
//!   artifact (only the names in [`super::ARTIFACTS`]);
//! - `GET /v1/top?window=30s` answers the live view's snapshot
//!   ([`crate::live::TopSnapshot`]: cumulative totals, the slowest
//!   requests of the window, the agent's line) for `tokentrace top --remote`.
//!
//! Bound to localhost by default, and every request needs `Authorization:
//! Bearer <token>`: the token of `--control-token-file`, or one the agent
//! generates at start into a root-only file (see [`super::token`]). A bind
//! beyond localhost is refused without `--control-token-file`. Request
//! heads are limited to 16 KiB and bodies to 64 KiB; artifacts are served
//! only by their fixed names and never through a symlink.

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
use super::{artifact_path, content_type, token};
use crate::config::Config;
use crate::live::LiveFeed;

/// Where the endpoint listens unless told otherwise.
pub const DEFAULT_ADDR: &str = "127.0.0.1:9465";
/// Longest session the endpoint accepts.
pub const MAX_DURATION: Duration = Duration::from_secs(3600);
/// Largest request body read (a session request is a few hundred bytes).
const MAX_BODY_BYTES: usize = 64 * 1024;
/// Largest request head (request line and headers) hyper buffers.
const MAX_HEAD_BYTES: usize = 16 * 1024;
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// The live view's window when `GET /v1/top` names none.
const DEFAULT_TOP_WINDOW: Duration = Duration::from_secs(30);

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

    /// The bearer token the control API requires: this file's content
    /// (trimmed). Without it the agent generates one into
    /// <session dir>/control.token (root only). Needed for a non-loopback
    /// --control-addr.
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
            .unwrap_or_else(|| PathBuf::from(token::DEFAULT_SESSION_DIR))
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

/// Starts the endpoint as `args` say. An explicit `--control-addr` that
/// cannot be bound is an error; the default address being taken (another
/// agent on this host) is only a warning.
pub async fn start(
    args: &ControlArgs,
    hub: SessionHub,
    live: Option<LiveFeed>,
) -> Result<Option<ControlServer>> {
    if args.no_control {
        return Ok(None);
    }
    let given = args
        .control_token_file
        .as_deref()
        .map(token::read_token)
        .transpose()
        .context("--control-token-file")?;
    let (addr, explicit) = match args.control_addr {
        Some(addr) => (addr, true),
        None => (
            DEFAULT_ADDR
                .parse()
                .context("the default control address")?,
            false,
        ),
    };
    if given.is_none() && !addr.ip().is_loopback() {
        bail!(
            "--control-addr {addr} is reachable from other hosts: give it a token they must present \
             (--control-token-file FILE), or bind to 127.0.0.1"
        );
    }
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
    let token = match given {
        Some(token) => token,
        None => {
            // No way in is safer than an open one: if the token cannot be
            // stored (read-only filesystem), the endpoint stays off.
            let dir = args.session_dir();
            match token::generate().and_then(|t| Ok((token::write_private(&dir, &t)?, t))) {
                Ok((path, token)) => {
                    eprintln!(
                        "tokentrace: control token in {} (root only; record --remote reads it)",
                        path.display()
                    );
                    token
                }
                Err(err) => {
                    tracing::warn!(
                        "control endpoint off: cannot store its token: {err:#} (give --control-token-file, or --session-dir on a writable filesystem)"
                    );
                    return Ok(None);
                }
            }
        }
    };
    eprintln!("tokentrace: control endpoint at http://{addr}");
    let state = Arc::new(State { hub, token, live });
    let task = tokio::spawn(serve(listener, state));
    Ok(Some(ControlServer { addr, task }))
}

/// The hub and endpoint of `tokentrace run`: both `None` with
/// `--no-control` or when the default address is taken.
/// How the daemon's sessions run (remote ones and triggered ones alike).
pub fn hub_settings(args: &ControlArgs, config: &Config) -> HubSettings {
    HubSettings {
        stitch: config.stitch.stitcher_config(),
        idle_timeout: config.stitch.idle_timeout,
        explain: config.explain.clone(),
        sessions_dir: args.session_dir(),
        allow_raw: args.control_allow_raw,
        max_duration: Some(MAX_DURATION),
    }
}

pub async fn for_run(
    args: &ControlArgs,
    config: &Config,
    live: Option<LiveFeed>,
) -> Result<(Option<SessionHub>, Option<ControlServer>)> {
    if args.no_control {
        return Ok((None, None));
    }
    let hub = SessionHub::new(hub_settings(args, config));
    Ok(match start(args, hub.clone(), live).await? {
        Some(server) => (Some(hub), Some(server)),
        None => (None, None),
    })
}

struct State {
    hub: SessionHub,
    token: String,
    live: Option<LiveFeed>,
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

fn authorized(req: &Request<Incoming>, token: &str) -> bool {
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
    let read = tokio::task::spawn_blocking(move || read_no_symlink(&path)).await;
    match read.unwrap_or_else(|err| Err(std::io::Error::other(err))) {
        Ok(bytes) => reply(StatusCode::OK, content_type(name), Bytes::from(bytes)),
        Err(err) if err.raw_os_error() == Some(libc::ELOOP) => error(
            StatusCode::FORBIDDEN,
            &format!("session {id}'s {name} is a symlink: not served"),
        ),
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

/// Reads an artifact, refusing a symlink in its place (O_NOFOLLOW: a link
/// planted there would hand out any file root can read).
fn read_no_symlink(path: &std::path::Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)?;
    Ok(bytes)
}

async fn handle(req: Request<Incoming>, state: &State) -> Reply {
    if !authorized(&req, &state.token) {
        let mut response = error(
            StatusCode::UNAUTHORIZED,
            "this endpoint needs Authorization: Bearer <token> (record --remote reads --token-file, TOKENTRACE_CONTROL_TOKEN, or the agent's root-only /var/lib/tokentrace/sessions/control.token)",
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
        (Method::GET, ["v1", "top"]) => top(&req, state.live.as_ref()),
        (Method::GET, [] | ["v1"]) => json(
            StatusCode::OK,
            &serde_json::json!({
                "service": "tokentrace session control",
                "version": env!("CARGO_PKG_VERSION"),
                "sessions": "/v1/sessions",
                "top": "/v1/top",
            }),
        ),
        _ => error(
            StatusCode::NOT_FOUND,
            "not found (the API is under /v1/sessions)",
        ),
    }
}

/// The live view's snapshot; `?window=` (humantime, at most
/// [`crate::live::MAX_WINDOW`]) bounds the slowest requests' age.
fn top(req: &Request<Incoming>, live: Option<&LiveFeed>) -> Reply {
    let Some(live) = live else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "this agent keeps no live view",
        );
    };
    let asked = req
        .uri()
        .query()
        .unwrap_or_default()
        .split('&')
        .find_map(|kv| kv.strip_prefix("window="));
    let window = match asked.map(humantime::parse_duration) {
        None => DEFAULT_TOP_WINDOW,
        Some(Ok(w)) if w > Duration::ZERO && w <= crate::live::MAX_WINDOW => w,
        Some(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                &format!(
                    "window must be a duration like 30s, at most {}",
                    humantime::format_duration(crate::live::MAX_WINDOW)
                ),
            )
        }
    };
    json(StatusCode::OK, &live.snapshot(crate::units::nanos(window)))
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
                .max_buf_size(MAX_HEAD_BYTES)
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
    use crate::session::hub::SelectorSpec;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn hub(dir: &std::path::Path) -> SessionHub {
        SessionHub::new(HubSettings {
            stitch: crate::stitch::StitchConfig::default(),
            idle_timeout: Duration::from_secs(300),
            explain: crate::config::ExplainConfig::default(),
            sessions_dir: dir.to_path_buf(),
            allow_raw: false,
            max_duration: Some(MAX_DURATION),
        })
    }

    /// One raw HTTP/1.1 exchange; returns the status code and the body.
    async fn exchange(addr: SocketAddr, head: &str, body: &[u8]) -> (u16, String) {
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let mut req = head.replace('\n', "\r\n").into_bytes();
        req.extend_from_slice(body);
        // the server may answer (and close) before reading a refused body
        let _ = stream.write_all(&req).await;
        let mut reply = Vec::new();
        let _ = stream.read_to_end(&mut reply).await;
        let text = String::from_utf8_lossy(&reply).to_string();
        let status = text
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let body = text
            .split("\r\n\r\n")
            .nth(1)
            .unwrap_or_default()
            .to_string();
        (status, body)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn by_default_only_the_root_only_generated_token_gets_in() {
        let dir = std::env::temp_dir().join(format!("tt-control-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let sessions = dir.join("sessions");
        let hub = hub(&sessions);
        let args = ControlArgs {
            control_addr: Some("127.0.0.1:0".parse().expect("addr")),
            session_dir: Some(sessions.clone()),
            ..ControlArgs::default()
        };
        let server = start(&args, hub.clone(), None)
            .await
            .expect("start")
            .expect("serving");
        let token_path = sessions.join(token::TOKEN_FILE_NAME);
        let token = token::read_token(&token_path).expect("generated token");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&token_path).map(|m| m.permissions().mode() & 0o777);
        assert_eq!(mode.ok(), Some(0o600));
        let addr = server.addr;
        let get = |path: &str, auth: Option<&str>| {
            format!(
                "GET {path} HTTP/1.1\nHost: x\nConnection: close\n{}\n",
                auth.map(|t| format!("Authorization: Bearer {t}\n"))
                    .unwrap_or_default()
            )
        };
        assert_eq!(exchange(addr, &get("/v1/sessions", None), b"").await.0, 401);
        assert_eq!(
            exchange(addr, &get("/v1/sessions", Some("guess")), b"")
                .await
                .0,
            401
        );
        assert_eq!(
            exchange(addr, &get("/v1/sessions", Some(&token)), b"")
                .await
                .0,
            200
        );
        // heads and bodies are bounded
        let huge_header = format!(
            "GET /v1/sessions HTTP/1.1\nHost: x\nAuthorization: Bearer {token}\nX-Pad: {}\nConnection: close\n\n",
            "a".repeat(4 * MAX_HEAD_BYTES)
        );
        let (status, _) = exchange(addr, &huge_header, b"").await;
        assert!(status == 431 || status == 0, "oversized head: {status}");
        let big = vec![b' '; 2 * MAX_BODY_BYTES];
        let post = format!(
            "POST /v1/sessions HTTP/1.1\nHost: x\nAuthorization: Bearer {token}\nContent-Length: {}\nConnection: close\n\n",
            big.len()
        );
        let (status, body) = exchange(addr, &post, &big).await;
        assert_eq!(status, 400, "{body}");
        assert!(body.contains("at most 65536 bytes"), "{body}");

        // a finished session's artifacts: fixed names only, never a symlink
        let request = SessionRequest {
            selector: SelectorSpec::default(),
            duration: Some(Duration::from_secs(60)),
            profile_hz: 0,
            raw: false,
        };
        let session = hub.start(request, None).expect("session");
        assert!(hub.stop(&session.id));
        let done = tokio::task::spawn_blocking({
            let hub = hub.clone();
            let id = session.id.clone();
            move || hub.wait(&id)
        })
        .await
        .expect("wait");
        assert!(done.is_some());
        let artifacts = format!("/v1/sessions/{}/artifacts", session.id);
        let (status, _) = exchange(
            addr,
            &get(&format!("{artifacts}/requests.csv"), Some(&token)),
            b"",
        )
        .await;
        assert_eq!(status, 200);
        for name in [
            "..%2F..%2Fcontrol.token",
            "control.token",
            "%2Fetc%2Fpasswd",
            "..",
            "requests.csv%00",
        ] {
            let (status, body) = exchange(
                addr,
                &get(&format!("{artifacts}/{name}"), Some(&token)),
                b"",
            )
            .await;
            assert_eq!(status, 404, "{name}: {body}");
            assert!(!body.contains(&token));
        }
        let out = hub.artifacts_dir(&session.id).expect("artifacts dir");
        let planted = out.join("report.html");
        std::fs::remove_file(&planted).expect("remove report");
        std::os::unix::fs::symlink(&token_path, &planted).expect("symlink");
        let (status, body) = exchange(
            addr,
            &get(&format!("{artifacts}/report.html"), Some(&token)),
            b"",
        )
        .await;
        assert_eq!(status, 403, "{body}");
        assert!(!body.contains(&token), "the token leaked through a symlink");
        drop(server);
        hub.shutdown();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_bind_beyond_localhost_needs_a_token_file() {
        let dir = std::env::temp_dir().join(format!("tt-control-wide-{}", std::process::id()));
        let args = ControlArgs {
            control_addr: Some("0.0.0.0:0".parse().expect("addr")),
            session_dir: Some(dir.clone()),
            ..ControlArgs::default()
        };
        let err = start(&args, hub(&dir), None).await.expect_err("refused");
        assert!(err.to_string().contains("--control-token-file"), "{err:#}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(same_token(b"secret", b"secret"));
        assert!(!same_token(b"secreT", b"secret"));
        assert!(!same_token(b"secret1", b"secret"));
        assert!(!same_token(b"", b"secret"));
    }
}
