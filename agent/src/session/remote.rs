//! `tokentrace record --remote http://node:port`: the control endpoint's
//! client. Starts a session on the node's agent, shows its progress, stops
//! it early on Ctrl-C, and downloads its artifacts.

use std::future::Future;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE};
use hyper::{Method, Request, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::hub::{SessionRequest, SessionState, SessionStatus};
use super::progress::ProgressPrinter;
use super::Artifact;

/// How long one API call may take (downloads of large artifacts included).
const CALL_TIMEOUT: Duration = Duration::from_secs(120);
/// How often a running session is polled.
const POLL_EVERY: Duration = Duration::from_secs(1);
/// How long to wait past the session's own duration before giving up.
const GRACE: Duration = Duration::from_secs(120);

/// A client of one agent's control endpoint.
pub struct RemoteClient {
    base: String,
    token: Option<String>,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl RemoteClient {
    /// `url` is `http://host:port` (TLS is not spoken: reach a remote node
    /// through an SSH tunnel or `kubectl port-forward`).
    pub fn new(url: &str, token: Option<String>) -> Result<Self> {
        let uri: Uri = url
            .parse()
            .with_context(|| format!("--remote {url:?} is not a URL like http://node:9465"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(other) => bail!(
                "--remote {url}: scheme {other} is not supported; the control endpoint speaks plain http \
                 (use an SSH tunnel or kubectl port-forward to reach it securely)"
            ),
            None => bail!("--remote {url}: give a URL like http://node:9465"),
        }
        let authority = uri
            .authority()
            .with_context(|| format!("--remote {url}: no host"))?;
        Ok(Self {
            base: format!("http://{authority}"),
            token,
            client: Client::builder(TokioExecutor::new()).build_http(),
        })
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes)> {
        let url = format!("{}{path}", self.base);
        let mut builder = Request::builder().method(method.clone()).uri(&url);
        if let Some(token) = &self.token {
            let value = HeaderValue::from_str(&format!("Bearer {token}"))
                .context("the control token has characters a header cannot carry")?;
            builder = builder.header(AUTHORIZATION, value);
        }
        if body.is_some() {
            builder = builder.header(CONTENT_TYPE, "application/json");
        }
        let request = builder
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .with_context(|| format!("building {method} {url}"))?;
        let exchange = async {
            let response = self.client.request(request).await.with_context(|| {
                format!("{method} {url}: is `tokentrace run` serving its control endpoint there?")
            })?;
            let status = response.status();
            let body = response
                .into_body()
                .collect()
                .await
                .with_context(|| format!("{method} {url}: reading the reply"))?
                .to_bytes();
            Ok::<_, anyhow::Error>((status, body))
        };
        tokio::time::timeout(CALL_TIMEOUT, exchange)
            .await
            .with_context(|| format!("{method} {url}: no reply within {CALL_TIMEOUT:?}"))?
    }

    /// A JSON reply, or the endpoint's error message.
    async fn call_json<T: serde::de::DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
        expect: StatusCode,
    ) -> Result<T> {
        let (status, bytes) = self.call(method.clone(), path, body).await?;
        if status != expect {
            let message = serde_json::from_slice::<serde_json::Value>(&bytes)
                .ok()
                .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
                .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
            bail!("{method} {path}: {status}: {message}");
        }
        serde_json::from_slice(&bytes).with_context(|| format!("{method} {path}: unexpected reply"))
    }

    pub async fn start(&self, request: &SessionRequest) -> Result<SessionStatus> {
        let body = serde_json::to_vec(request)?;
        self.call_json(
            Method::POST,
            "/v1/sessions",
            Some(body),
            StatusCode::CREATED,
        )
        .await
    }

    pub async fn status(&self, id: &str) -> Result<SessionStatus> {
        self.call_json(
            Method::GET,
            &format!("/v1/sessions/{id}"),
            None,
            StatusCode::OK,
        )
        .await
    }

    pub async fn stop(&self, id: &str) -> Result<()> {
        let _: Option<SessionStatus> = self
            .call_json(
                Method::POST,
                &format!("/v1/sessions/{id}/stop"),
                None,
                StatusCode::ACCEPTED,
            )
            .await?;
        Ok(())
    }

    /// The agent's live view snapshot (`tokentrace top --remote`).
    pub async fn top(&self, window: Duration) -> Result<crate::live::TopSnapshot> {
        let path = format!("/v1/top?window={}ms", window.as_millis());
        self.call_json(Method::GET, &path, None, StatusCode::OK)
            .await
    }

    pub async fn download(&self, id: &str, name: &str) -> Result<Bytes> {
        let path = format!("/v1/sessions/{id}/artifacts/{name}");
        let (status, bytes) = self.call(Method::GET, &path, None).await?;
        if status != StatusCode::OK {
            bail!("GET {path}: {status}: {}", String::from_utf8_lossy(&bytes));
        }
        Ok(bytes)
    }
}

/// Runs a remote session to its end (or until `interrupt` fires, which
/// stops it early) and downloads its artifacts into `out`.
pub async fn record(
    client: &RemoteClient,
    request: &SessionRequest,
    out: &Path,
    interrupt: impl Future<Output = ()>,
) -> Result<(SessionStatus, Vec<Artifact>)> {
    let started = client.start(request).await?;
    let id = started.id.clone();
    eprintln!("tokentrace: session {id} started on {}", client.base);
    let give_up = tokio::time::Instant::now() + request.duration.unwrap_or_default() + GRACE;
    let mut printer = ProgressPrinter::default();
    let mut stopping = false;
    tokio::pin!(interrupt);
    let status = loop {
        tokio::select! {
            _ = tokio::time::sleep(POLL_EVERY) => {}
            _ = &mut interrupt, if !stopping => {
                stopping = true;
                printer.done();
                eprintln!("tokentrace: stopping session {id}; its artifacts are still written");
                client.stop(&id).await?;
            }
        }
        let status = client.status(&id).await?;
        match status.state {
            SessionState::Done | SessionState::Failed => break status,
            SessionState::Running | SessionState::Finishing => printer.show(&status.progress),
        }
        if tokio::time::Instant::now() >= give_up {
            bail!("session {id} did not finish within {GRACE:?} of its duration");
        }
    };
    printer.done();
    if status.state == SessionState::Failed {
        bail!(
            "session {id} failed: {}",
            status.error.as_deref().unwrap_or("no reason given")
        );
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mut written = Vec::new();
    for artifact in &status.artifacts {
        let bytes = client.download(&id, &artifact.name).await?;
        let path = out.join(&artifact.name);
        std::fs::write(&path, &bytes).with_context(|| format!("writing {}", path.display()))?;
        written.push(Artifact {
            name: artifact.name.clone(),
            bytes: bytes.len() as u64,
        });
    }
    Ok((status, written))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::control::{self, ControlArgs};
    use crate::session::core::tests::sse_exchange;
    use crate::session::hub::{HubSettings, SelectorSpec, SessionHub};
    use crate::stitch::StitchConfig;

    #[test]
    fn only_plain_http_urls() {
        assert!(RemoteClient::new("http://node-1:9465", None).is_ok());
        assert!(RemoteClient::new("https://node-1:9465", None).is_err());
        assert!(RemoteClient::new("node-1:9465", None).is_err());
    }

    /// The control endpoint and this client end to end, in-process: a
    /// session started over HTTP sees the events the hub is fed, and its
    /// artifacts download. (The root-only test does the same against a
    /// real `tokentrace run`.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn remote_session_over_http() {
        let dir = std::env::temp_dir().join(format!("tt-remote-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let token_file = dir.join("token");
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(&token_file, "t0ken\n").expect("token");
        let hub = SessionHub::new(HubSettings {
            stitch: StitchConfig::default(),
            idle_timeout: Duration::from_secs(300),
            explain: crate::config::ExplainConfig::default(),
            sessions_dir: dir.join("sessions"),
            allow_raw: false,
            max_duration: Some(control::MAX_DURATION),
        });
        let args = ControlArgs {
            control_addr: Some("127.0.0.1:0".parse().expect("addr")),
            control_token_file: Some(token_file),
            ..ControlArgs::default()
        };
        let server = control::start(&args, hub.clone(), None)
            .await
            .expect("start")
            .expect("serving");
        let url = format!("http://{}", server.addr);

        let anonymous = RemoteClient::new(&url, None).expect("client");
        let denied = anonymous.status("x").await.expect_err("no token");
        assert!(denied.to_string().contains("401"), "{denied:#}");

        let client = RemoteClient::new(&url, Some("t0ken".into())).expect("client");
        let raw = SessionRequest {
            selector: SelectorSpec::default(),
            duration: Some(Duration::from_secs(2)),
            profile_hz: 0,
            raw: true,
        };
        let refused = client.start(&raw).await.expect_err("raw is off");
        assert!(refused.to_string().contains("403"), "{refused:#}");

        let feeder = {
            let hub = hub.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                hub.on_events(&sse_exchange(
                    5_000_000_000,
                    4,
                    "/v1/chat/completions?rid=r",
                ));
            })
        };
        let request = SessionRequest { raw: false, ..raw };
        let out = dir.join("out");
        let (status, artifacts) = record(&client, &request, &out, std::future::pending())
            .await
            .expect("remote record");
        feeder.await.expect("feeder");
        assert_eq!(status.state, SessionState::Done);
        assert_eq!(status.progress.requests, 1);
        assert_eq!(artifacts.len(), 5);
        let jsonl = std::fs::read_to_string(out.join("requests.jsonl")).expect("jsonl");
        assert!(jsonl.contains("rid=r"));
        let missing = client.download(&status.id, "../../etc/passwd").await;
        assert!(missing.is_err());
        drop(server);
        hub.shutdown();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
