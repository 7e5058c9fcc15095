//! nginx for the root tests: in the foreground, one worker, its prefix,
//! config, pid file and logs in the test's own directory, serving the
//! `server { … }` block a test gives it.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use super::tls::TlsDir;
use super::{child_pids, free_port, Proc};

pub fn nginx_bin() -> String {
    for p in [
        "/usr/sbin/nginx",
        "/usr/local/sbin/nginx",
        "/usr/local/nginx/sbin/nginx",
    ] {
        if Path::new(p).is_file() {
            return p.to_string();
        }
    }
    "nginx".to_string()
}

/// nginx in the foreground (one worker) with its prefix, config and logs in
/// `dir`, serving `server_block` (an http `server { … }` whose `listen`
/// uses `{port}`, replaced by a free port).
pub struct Nginx {
    pub master: Proc,
    pub worker: u32,
    pub port: u16,
    error_log: PathBuf,
}

impl Nginx {
    pub fn start(dir: &Path, server_block: &str) -> Nginx {
        let port = free_port();
        let d = dir.display();
        let conf = dir.join("nginx.conf");
        let error_log = dir.join("error.log");
        let server_block = server_block.replace("{port}", &port.to_string());
        let text = format!(
            "# a tokentrace root test\n\
             daemon off;\nmaster_process on;\nworker_processes 1;\nuser root;\n\
             pid {d}/nginx.pid;\nerror_log {d}/error.log info;\n\
             events {{ worker_connections 256; }}\n\
             http {{\n    access_log off;\n\
             client_body_temp_path {d}/client_body;\n    proxy_temp_path {d}/proxy;\n\
             fastcgi_temp_path {d}/fastcgi;\n    uwsgi_temp_path {d}/uwsgi;\n\
             scgi_temp_path {d}/scgi;\n{server_block}\n}}\n"
        );
        std::fs::write(&conf, text).expect("write nginx.conf");
        let bin = nginx_bin();
        let mut cmd = Command::new(&bin);
        cmd.arg("-p")
            .arg(dir)
            .arg("-c")
            .arg(&conf)
            .arg("-e")
            .arg(&error_log);
        let mut master = Proc::spawn("nginx", &mut cmd);
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(st) = master.try_exit() {
                panic!(
                    "nginx ({bin}) exited at start ({st}); is it installed (apt-get install nginx; \
                     `cargo xtask deps` does)? stderr:\n{}\nerror.log:\n{}",
                    master.stderr.tail(20),
                    std::fs::read_to_string(&error_log).unwrap_or_default()
                );
            }
            let workers = child_pids(master.pid());
            if workers.len() == 1 && TcpStream::connect(("127.0.0.1", port)).is_ok() {
                eprintln!(
                    "[test] nginx master {} worker {} on port {port}",
                    master.pid(),
                    workers[0]
                );
                return Nginx {
                    master,
                    worker: workers[0],
                    port,
                    error_log,
                };
            }
            assert!(
                Instant::now() < deadline,
                "nginx not listening on {port} with one worker within 15 s; error.log:\n{}",
                std::fs::read_to_string(&error_log).unwrap_or_default()
            );
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        if thread::panicking() {
            let log = std::fs::read_to_string(&self.error_log).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            let from = lines.len().saturating_sub(30);
            eprintln!(
                "---- nginx error.log tail ----\n{}",
                lines[from..].join("\n")
            );
        }
        // fast shutdown: the master stops its worker; SIGKILL (the Proc
        // guard) would leave it running
        self.master.signal(libc::SIGTERM);
        let _ = self.master.wait_timeout(Duration::from_secs(5));
        let comm =
            std::fs::read_to_string(format!("/proc/{}/comm", self.worker)).unwrap_or_default();
        if comm.trim() == "nginx" {
            // SAFETY: kill(2) on the worker our nginx forked
            unsafe {
                libc::kill(self.worker as libc::pid_t, libc::SIGKILL);
            }
        }
    }
}

/// The server block of nginx terminating TLS on `{port}` and proxying to
/// `upstream` without buffering.
pub fn tls_proxy_block(dir: &TlsDir, upstream: u16) -> String {
    format!(
        r#"    server {{
        listen 127.0.0.1:{{port}} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        ssl_protocols TLSv1.2 TLSv1.3;
        keepalive_timeout 60s;
        keepalive_requests 10000;
        location / {{
            proxy_pass http://127.0.0.1:{upstream};
            proxy_http_version 1.1;
            proxy_buffering off;
            chunked_transfer_encoding on;
        }}
    }}"#,
        cert = dir.cert(),
        key = dir.key()
    )
}
