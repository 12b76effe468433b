//! A real headless Chromium, driven through `tests/browser.py` (the DevTools protocol over
//! Debian's python3-websockets): evaluate JavaScript in a page, see its dialogs and errors,
//! take screenshots. Killed on drop.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::TempDir;

pub struct Browser {
    child: Child,
    /// None once closed (on drop), which ends the driver.
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    dir: TempDir,
}

/// The browser to drive: `$SLUICE_CHROMIUM`, else Debian's `chromium`.
fn chromium() -> String {
    let path = std::env::var("SLUICE_CHROMIUM").unwrap_or_else(|_| "chromium".into());
    let found = Command::new(&path)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "{path} not found: the console tests drive a real headless Chromium \
         (`make deps`, or: sudo apt-get install -y chromium)"
    );
    path
}

impl Browser {
    /// Chromium showing `url` in a `width`×`height` viewport.
    pub fn open(url: &str, width: u32, height: u32) -> Browser {
        let chromium = chromium();
        let dir = TempDir::new();
        let mut child = Command::new(super::python_with_websockets("the browser driver"))
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/browser.py"))
            .arg(chromium)
            .arg(&dir.0)
            .arg(url)
            .arg(width.to_string())
            .arg(height.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start tests/browser.py");
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut b = Browser {
            child,
            stdin,
            stdout,
            dir,
        };
        let ready = b.answer();
        assert_eq!(ready, Ok(json!("ready")), "{}", b.log());
        b
    }

    fn log(&self) -> String {
        let log = std::fs::read_to_string(self.dir.0.join("chromium.log")).unwrap_or_default();
        format!("chromium's log:\n{log}")
    }

    fn answer(&mut self) -> Result<Value, String> {
        let mut line = String::new();
        self.stdout
            .read_line(&mut line)
            .expect("read from tests/browser.py");
        if line.is_empty() {
            panic!("tests/browser.py exited\n{}", self.log());
        }
        let v: Value = serde_json::from_str(&line).expect("a JSON answer");
        match v.get("error") {
            Some(e) => Err(e.as_str().unwrap_or_default().to_owned()),
            None => Ok(v.get("value").cloned().unwrap_or(Value::Null)),
        }
    }

    fn send(&mut self, command: Value) -> Result<Value, String> {
        let stdin = self.stdin.as_mut().expect("open");
        writeln!(stdin, "{command}").expect("write to tests/browser.py");
        stdin.flush().expect("flush");
        self.answer()
    }

    /// The value of `js` (an expression; a promise is awaited), or the exception it threw.
    pub fn try_eval(&mut self, js: &str) -> Result<Value, String> {
        self.send(json!({"op": "eval", "expr": js}))
    }

    pub fn eval(&mut self, js: &str) -> Value {
        self.try_eval(js)
            .unwrap_or_else(|e| panic!("evaluating {js}: {e}"))
    }

    /// Waits up to `timeout` for `js` to be truthy (not false, null, 0 or ""), and returns it.
    pub fn wait_for(&mut self, what: &str, timeout: Duration, js: &str) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let v = self.try_eval(js);
            let truthy = match &v {
                Ok(Value::Null | Value::Bool(false)) | Err(_) => false,
                Ok(Value::Number(n)) => n.as_f64() != Some(0.0),
                Ok(Value::String(s)) => !s.is_empty(),
                Ok(_) => true,
            };
            if truthy {
                return v.unwrap_or_default();
            }
            assert!(
                Instant::now() < deadline,
                "waited {timeout:?} for {what}; last: {v:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn navigate(&mut self, url: &str) {
        self.send(json!({"op": "navigate", "url": url}))
            .unwrap_or_else(|e| panic!("navigating to {url}: {e}"));
    }

    pub fn screenshot(&mut self, path: &std::path::Path, width: u32, height: u32) {
        self.send(json!({"op": "screenshot", "path": path, "width": width, "height": height}))
            .unwrap_or_else(|e| panic!("screenshot: {e}"));
    }

    /// The messages of the dialogs (confirm) shown since the last call, all accepted, and the
    /// page's errors (uncaught exceptions, console errors, CSP reports).
    pub fn events(&mut self) -> (Vec<String>, Vec<String>) {
        let v = self
            .send(json!({"op": "events"}))
            .unwrap_or_else(|e| panic!("events: {e}"));
        let strings = |name: &str| -> Vec<String> {
            v[name]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|s| s.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default()
        };
        (strings("dialogs"), strings("problems"))
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Closing stdin ends the driver, which kills its Chromium (and Chromium gets SIGKILL
        // should the driver die first); a driver still running after 5 s is killed.
        self.stdin.take();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
