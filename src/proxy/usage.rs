//! Reading the tokens an LLM response reports (DESIGN §12 `cost = { usage = … }`), as the
//! body passes: whole JSON bodies and Server-Sent-Events streams, fed chunk by chunk.
//!
//! A whole JSON body is walked by a push scanner that keeps only the object keys on the
//! current path (each at most `MAX_KEY` bytes, at most `MAX_DEPTH` deep) and the digits of
//! the number being read, skipping string values with memchr, so a body of any length is
//! read in a few hundred bytes. The crates considered (actson, struson) keep every string
//! token whole, a completion's text included.
//!
//! An SSE stream is read where the three formats put their usage: its first event and its
//! last events (see `Sse`). The chunks between pass untouched, kept by reference while
//! they are among the last 64 KiB; the events read are framed here (each event's `data:`
//! lines are one JSON text) and scanned only if they hold a usage object.

use crate::config::UsageFormat;

/// Object keys longer than this match no usage path (they are skipped, not kept).
const MAX_KEY: usize = 32;
/// Nesting deeper than this is scanned but matches no usage path.
const MAX_DEPTH: usize = 16;
/// The most of one SSE event kept (the bound on what a stream holds).
const MAX_EVENT: usize = 64 * 1024;
/// SSE field names longer than this are not `data`.
const MAX_FIELD: usize = 8;

/// The numbers a format's cost is made of, by their place in the JSON (object keys from
/// the root; arrays are transparent, so Gemini's JSON array of chunks reads like its SSE).
/// Each value read at a path replaces the one before it (the last one seen wins).
const PATHS: &[(&[&str], Slot)] = &[
    // OpenAI chat completions (whole or the last chunk of a stream); the Responses API
    // as a whole body or in its `response.completed` event.
    (&["usage", "total_tokens"], Slot::OpenAiTotal),
    (&["response", "usage", "total_tokens"], Slot::OpenAiTotal),
    // Anthropic: a whole message's usage, `message_start`'s message.usage, then
    // `message_delta`'s cumulative usage.
    (&["usage", "input_tokens"], Slot::AnthropicInput),
    (&["message", "usage", "input_tokens"], Slot::AnthropicInput),
    (&["usage", "output_tokens"], Slot::AnthropicOutput),
    (
        &["message", "usage", "output_tokens"],
        Slot::AnthropicOutput,
    ),
    // Gemini, whole or streamed.
    (&["usageMetadata", "totalTokenCount"], Slot::GeminiTotal),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    OpenAiTotal,
    AnthropicInput,
    AnthropicOutput,
    GeminiTotal,
}

/// What a response's body said, fed to it as it passes.
#[derive(Debug)]
pub struct UsageMeter {
    body: Body,
    found: [Option<u64>; 4],
}

#[derive(Debug)]
enum Body {
    Json(Scanner),
    Sse(Sse),
}

impl UsageMeter {
    /// A meter for a body of `content_type` (`text/event-stream` is read as SSE, anything
    /// else as one JSON text).
    pub fn new(content_type: Option<&[u8]>) -> UsageMeter {
        let sse = content_type
            .is_some_and(|t| t.len() >= 17 && t[..17].eq_ignore_ascii_case(b"text/event-stream"));
        UsageMeter {
            body: if sse {
                Body::Sse(Sse::default())
            } else {
                Body::Json(Scanner::default())
            },
            found: [None; 4],
        }
    }

    pub fn feed(&mut self, bytes: &bytes::Bytes) {
        match &mut self.body {
            Body::Json(json) => json.feed(bytes, &mut self.found),
            Body::Sse(sse) => sse.feed(bytes, &mut self.found),
        }
    }

    /// The body ended whole: what its end says is read.
    pub fn finish(&mut self) {
        match &mut self.body {
            // A number at the very end of the text ends with it.
            Body::Json(json) => json.feed(b" ", &mut self.found),
            Body::Sse(sse) => sse.finish(&mut self.found),
        }
    }

    /// The cost in `format`, if the body reported it.
    pub fn cost(&self, format: UsageFormat) -> Option<u64> {
        let get = |slot: Slot| self.found[slot as usize];
        match format {
            UsageFormat::OpenAi => get(Slot::OpenAiTotal),
            UsageFormat::Gemini => get(Slot::GeminiTotal),
            UsageFormat::Anthropic => {
                match (get(Slot::AnthropicInput), get(Slot::AnthropicOutput)) {
                    (None, None) => None,
                    (input, output) => Some(input.unwrap_or(0) + output.unwrap_or(0)),
                }
            }
        }
    }
}

/// An SSE stream, read where the three formats put their usage: the first event
/// (Anthropic's `message_start` has the input tokens) and the last events (every format's
/// final, or cumulative, usage). The chunks between pass untouched: a stream costs a
/// reference to each chunk, not a pass over its bytes. The chunks covering the last
/// `MAX_EVENT` bytes are kept (by reference) until the stream ends; then the last event
/// holding a usage object is framed and scanned.
#[derive(Debug, Default)]
struct Sse {
    /// The stream so far, until its first event has ended (at most `MAX_EVENT` bytes).
    head: Vec<u8>,
    head_done: bool,
    /// The latest chunks, covering at least the last `MAX_EVENT` bytes when there are as many.
    tail: std::collections::VecDeque<bytes::Bytes>,
    tail_len: usize,
    /// Chunks have left the tail: it no longer starts where the stream did.
    dropped: bool,
    /// How this stream ends lines (from its first line end): a blank line is two of them.
    blank_line: Option<&'static [u8]>,
}

impl Sse {
    fn feed(&mut self, chunk: &bytes::Bytes, found: &mut [Option<u64>; 4]) {
        if self.blank_line.is_none() {
            let cr_before = self.head.last() == Some(&b'\r');
            self.blank_line = match memchr::memchr2(b'\n', b'\r', chunk).map(|at| &chunk[at..]) {
                Some([b'\n', ..]) if cr_before && chunk[0] == b'\n' => Some(b"\r\n\r\n"),
                Some([b'\r', b'\n', ..]) => Some(b"\r\n\r\n"),
                // A CR last: whether an LF follows is for the next chunk to say.
                Some([b'\r']) => None,
                Some([b'\r', ..]) => Some(b"\r\r"),
                Some(_) => Some(b"\n\n"),
                None => None,
            };
        }
        if !self.head_done {
            self.read_head(chunk, found);
        }
        self.tail_len += chunk.len();
        self.tail.push_back(chunk.clone());
        while self
            .tail
            .front()
            .is_some_and(|c| self.tail_len - c.len() >= MAX_EVENT)
        {
            if let Some(old) = self.tail.pop_front() {
                self.tail_len -= old.len();
                self.dropped = true;
            }
        }
    }

    /// The first event, framed and scanned once it has ended. Only an event that spans
    /// chunks is copied; then at most `MAX_EVENT` bytes of it.
    fn read_head(&mut self, chunk: &[u8], found: &mut [Option<u64>; 4]) {
        let Some(blank) = self.blank_line else {
            self.keep_head(chunk);
            return;
        };
        if self.head.is_empty() {
            if let Some(at) = find_blank(chunk, blank) {
                Framer::default().feed(&chunk[..at + blank.len()], found);
                self.head_done = true;
                return;
            }
            self.keep_head(chunk);
            return;
        }
        // A blank line may begin in what was kept.
        let start = self.head.len().saturating_sub(blank.len() - 1);
        let joined = chunk.len().min(MAX_EVENT.saturating_sub(self.head.len()));
        self.head.extend_from_slice(&chunk[..joined]);
        match find_blank(&self.head[start..], blank) {
            Some(at) => {
                let end = start + at + blank.len();
                Framer::default().feed(&self.head[..end], found);
                self.head_done = true;
                self.head = Vec::new();
            }
            None if self.head.len() >= MAX_EVENT => {
                self.head_done = true;
                self.head = Vec::new();
            }
            None => {}
        }
    }

    fn keep_head(&mut self, chunk: &[u8]) {
        let room = MAX_EVENT.saturating_sub(self.head.len());
        self.head.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if self.head.len() >= MAX_EVENT {
            self.head_done = true;
            self.head = Vec::new();
        }
    }

    /// The stream ended: the last event holding a usage object is read.
    fn finish(&mut self, found: &mut [Option<u64>; 4]) {
        let Some(blank) = self.blank_line else { return };
        // Most often that event lies whole in the last chunk; else in the kept tail joined.
        if let Some(last) = self.tail.back() {
            let from_start = !self.dropped && self.tail.len() == 1;
            if let Some(event) = last_usage_event(last, blank, from_start) {
                Framer::default().feed(event, found);
                return;
            }
        }
        if self.tail.len() < 2 {
            return;
        }
        let mut joined = Vec::with_capacity(self.tail_len);
        for chunk in &self.tail {
            joined.extend_from_slice(chunk);
        }
        if let Some(event) = last_usage_event(&joined, blank, !self.dropped) {
            Framer::default().feed(event, found);
        }
    }
}

/// The last complete event in `text` that holds a usage object; `from_start` when `text`
/// may begin with an event (no blank line before it is needed).
fn last_usage_event<'a>(text: &'a [u8], blank: &[u8], from_start: bool) -> Option<&'a [u8]> {
    static KEY: std::sync::LazyLock<memchr::memmem::FinderRev<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::FinderRev::new(b"\"usage"));
    let at = KEY.rfind_iter(text).find(|&at| usage_object_at(text, at))?;
    let start = match rfind_blank(&text[..at], blank) {
        Some(b) => b + blank.len(),
        None if from_start => 0,
        None => return None,
    };
    let end = at + find_blank(&text[at..], blank)? + blank.len();
    Some(&text[start..end])
}

/// Where the first `blank` line starts in `text`.
fn find_blank(text: &[u8], blank: &[u8]) -> Option<usize> {
    let first = *blank.first()?;
    memchr::memchr_iter(first, text).find(|&at| text[at..].starts_with(blank))
}

/// SSE framing (the WHATWG event stream): lines end at LF, CR or CRLF; a blank line ends
/// an event; `data` lines carry the event's JSON, joined by newlines. Run only over text
/// that may hold usage (see `Sse`).
#[derive(Debug, Default)]
struct Framer {
    /// The current event's data so far.
    event: Vec<u8>,
    /// The current event is longer than `MAX_EVENT`: it is dropped.
    too_long: bool,
    /// The field name read so far on this line, while in it.
    field: [u8; MAX_FIELD],
    field_len: usize,
    state: Line,
    /// The line so far is empty (so an end of line here ends the event).
    blank: bool,
    /// The last byte was CR (an LF right after it ends nothing more).
    after_cr: bool,
    /// The event has had a data line.
    has_data: bool,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// Reading the field name.
    #[default]
    Field,
    /// After `data:`, before the optional space.
    DataStart,
    /// In a `data` value: bytes are kept for the event.
    Data,
    /// In a line that is not data (or a comment): skipped.
    Skip,
}

impl Framer {
    fn feed(&mut self, bytes: &[u8], found: &mut [Option<u64>; 4]) {
        let mut i = 0;
        while i < bytes.len() {
            let b = bytes[i];
            if b == b'\n' && self.after_cr {
                self.after_cr = false;
                i += 1;
                continue;
            }
            self.after_cr = b == b'\r';
            if b == b'\n' || b == b'\r' {
                self.end_line(found);
                i += 1;
                continue;
            }
            self.blank = false;
            match self.state {
                Line::Data | Line::Skip => {
                    // The rest of the line in one step: kept, or skipped.
                    let end =
                        memchr::memchr2(b'\n', b'\r', &bytes[i..]).map_or(bytes.len(), |n| i + n);
                    if self.state == Line::Data {
                        self.keep(&bytes[i..end]);
                    }
                    i = end;
                    continue;
                }
                Line::Field => {
                    if b == b':' {
                        self.state = if &self.field[..self.field_len] == b"data" {
                            Line::DataStart
                        } else {
                            Line::Skip
                        };
                    } else if self.field_len < MAX_FIELD {
                        self.field[self.field_len] = b;
                        self.field_len += 1;
                    } else {
                        self.state = Line::Skip;
                    }
                }
                Line::DataStart => {
                    self.state = Line::Data;
                    if self.has_data {
                        // Lines of one event's data are joined by a newline.
                        self.keep(b"\n");
                    }
                    self.has_data = true;
                    if b != b' ' {
                        // Not the optional space: this byte is data.
                        continue;
                    }
                }
            }
            i += 1;
        }
    }

    fn keep(&mut self, data: &[u8]) {
        if self.event.len() + data.len() > MAX_EVENT {
            self.too_long = true;
            self.event = Vec::new();
        }
        if !self.too_long {
            self.event.extend_from_slice(data);
        }
    }

    fn end_line(&mut self, found: &mut [Option<u64>; 4]) {
        if self.state == Line::DataStart {
            // `data:` with nothing after it: an empty data line.
            if self.has_data {
                self.keep(b"\n");
            }
            self.has_data = true;
        }
        if self.blank {
            // The event ends: its JSON is read if it holds a usage object.
            if !self.too_long && holds_usage(&self.event) {
                let mut json = Scanner::default();
                json.feed(&self.event, found);
                // A number at the very end of the text ends with it.
                json.feed(b" ", found);
            }
            self.event.clear();
            self.too_long = false;
            self.has_data = false;
        }
        self.state = Line::Field;
        self.field_len = 0;
        self.blank = true;
    }
}

/// Whether `json` has a key `usage` or `usageMetadata` whose value is an object: only
/// then can the scanner find a usage path in it.
fn holds_usage(json: &[u8]) -> bool {
    // Built once: a searcher costs more to make than most events take to search.
    static KEY: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"usage"));
    KEY.find_iter(json).any(|at| usage_object_at(json, at))
}

/// Where the last `blank` line (two line ends: LF LF, CR CR or CRLF CRLF) starts in
/// `text`. By its last byte, as the boundary is usually near the end: no searcher to build.
fn rfind_blank(text: &[u8], blank: &[u8]) -> Option<usize> {
    let last = *blank.last()?;
    memchr::memrchr_iter(last, text).find_map(|at| {
        let start = (at + 1).checked_sub(blank.len())?;
        (&text[start..=at] == blank).then_some(start)
    })
}

fn skip_spaces(r: &[u8]) -> &[u8] {
    let at = r.iter().position(|b| !matches!(b, b' ' | b'\t'));
    at.map_or(&[][..], |at| &r[at..])
}

/// Whether the `"usage` at `at` in `text` is the key `usage` or `usageMetadata` of an
/// object value.
fn usage_object_at(text: &[u8], at: usize) -> bool {
    let rest = &text[at + 6..];
    let Some(rest) = rest
        .strip_prefix(b"\"")
        .or_else(|| rest.strip_prefix(b"Metadata\""))
    else {
        return false;
    };
    // Spaces only: a line end may be the JSON going on in the event's next data line.
    match skip_spaces(rest).strip_prefix(b":") {
        Some(value) => matches!(skip_spaces(value).first(), Some(b'{' | b'\n' | b'\r')),
        None => matches!(skip_spaces(rest).first(), Some(b'\n' | b'\r')),
    }
}

/// A push scanner over one JSON text that records the integers at `PATHS`. Malformed
/// input stops it (nothing more is recorded) rather than guessing.
#[derive(Debug)]
struct Scanner {
    /// Per open container: whether it is an object, and that object's current key.
    frames: Vec<Frame>,
    /// Containers open beyond `MAX_DEPTH` (not kept in `frames`).
    overflow: usize,
    state: State,
    /// In an object, the next string is a key.
    expect_key: bool,
    key: Key,
    number: [u8; 20],
    number_len: usize,
    /// The number has a fraction, an exponent or too many digits: not a token count.
    number_odd: bool,
}

#[derive(Debug, Default, Clone, Copy)]
struct Key {
    bytes: [u8; MAX_KEY],
    /// usize::MAX: too long to match anything.
    len: usize,
}

impl Key {
    fn as_bytes(&self) -> &[u8] {
        if self.len > MAX_KEY {
            b"\0"
        } else {
            &self.bytes[..self.len]
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Frame {
    object: bool,
    key: Key,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Between tokens.
    Between,
    /// In a string; `key` says whether it is an object key (kept) or a value (skipped).
    Str {
        key: bool,
        escaped: bool,
    },
    Number,
    /// In `true`, `false` or `null`.
    Literal,
    /// Malformed input, or the text ended: nothing more is read.
    Stopped,
}

impl Default for Scanner {
    fn default() -> Scanner {
        Scanner {
            frames: Vec::new(),
            overflow: 0,
            state: State::Between,
            expect_key: false,
            key: Key::default(),
            number: [0; 20],
            number_len: 0,
            number_odd: false,
        }
    }
}

impl Scanner {
    fn feed(&mut self, bytes: &[u8], found: &mut [Option<u64>; 4]) {
        let mut i = 0;
        while i < bytes.len() {
            let b = bytes[i];
            match self.state {
                State::Stopped => return,
                State::Str { key, escaped } => {
                    if escaped {
                        self.state = State::Str {
                            key,
                            escaped: false,
                        };
                        if key {
                            // An escape in a key: no usage key has one.
                            self.key.len = usize::MAX;
                        }
                    } else if b == b'\\' {
                        self.state = State::Str { key, escaped: true };
                    } else if b == b'"' {
                        self.state = State::Between;
                        if key {
                            if let Some(frame) =
                                self.frames.last_mut().filter(|_| self.overflow == 0)
                            {
                                frame.key = self.key;
                            }
                        }
                    } else if key && self.key.len < MAX_KEY {
                        self.key.bytes[self.key.len] = b;
                        self.key.len += 1;
                    } else if key {
                        self.key.len = usize::MAX;
                    } else if let Some(at) = memchr::memchr2(b'"', b'\\', &bytes[i..]) {
                        // Skip a value's text in one step.
                        i += at;
                        continue;
                    } else {
                        return;
                    }
                }
                State::Number => {
                    if b.is_ascii_digit() {
                        if self.number_len < self.number.len() {
                            self.number[self.number_len] = b;
                            self.number_len += 1;
                        } else {
                            self.number_odd = true;
                        }
                    } else if matches!(b, b'.' | b'e' | b'E' | b'+' | b'-') {
                        self.number_odd = true;
                    } else {
                        self.end_number(found);
                        self.state = State::Between;
                        continue;
                    }
                }
                State::Literal => {
                    if !b.is_ascii_lowercase() {
                        self.state = State::Between;
                        continue;
                    }
                }
                State::Between => self.token(b),
            }
            i += 1;
        }
    }

    fn token(&mut self, b: u8) {
        match b {
            b' ' | b'\t' | b'\n' | b'\r' => {}
            b'{' | b'[' => {
                if self.frames.len() < MAX_DEPTH && self.overflow == 0 {
                    self.frames.push(Frame {
                        object: b == b'{',
                        key: Key::default(),
                    });
                } else {
                    self.overflow += 1;
                }
                self.expect_key = b == b'{';
            }
            b'}' | b']' => {
                if self.overflow > 0 {
                    self.overflow -= 1;
                } else if self.frames.pop().is_none() {
                    self.state = State::Stopped;
                    return;
                }
                self.expect_key = false;
                if self.frames.is_empty() && self.overflow == 0 {
                    // The text is complete: whatever follows is not part of it.
                    self.state = State::Stopped;
                }
            }
            b':' => self.expect_key = false,
            b',' => self.expect_key = self.in_object(),
            b'"' => {
                let key = self.expect_key && self.in_object();
                if key {
                    self.key = Key::default();
                }
                self.state = State::Str {
                    key,
                    escaped: false,
                };
            }
            b'-' | b'0'..=b'9' => {
                self.state = State::Number;
                self.number_len = 0;
                self.number_odd = b == b'-';
                if b != b'-' {
                    self.number[0] = b;
                    self.number_len = 1;
                }
            }
            b't' | b'f' | b'n' => self.state = State::Literal,
            _ => self.state = State::Stopped,
        }
    }

    fn in_object(&self) -> bool {
        self.overflow == 0 && self.frames.last().is_some_and(|f| f.object)
    }

    fn end_number(&mut self, found: &mut [Option<u64>; 4]) {
        if self.number_odd || self.number_len == 0 || self.overflow > 0 {
            return;
        }
        let Some(value) = std::str::from_utf8(&self.number[..self.number_len])
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
        else {
            return;
        };
        let keys = || self.frames.iter().filter(|f| f.object).map(|f| f.key);
        let depth = keys().count();
        for (path, slot) in PATHS {
            if path.len() == depth
                && keys()
                    .zip(path.iter())
                    .all(|(k, p)| k.as_bytes() == p.as_bytes())
            {
                found[*slot as usize] = Some(value);
            }
        }
    }
}

/// `reserve = "request"`: a JSON request's upper bound on the tokens it may cost, its
/// bytes / 4 for the input plus the largest output bound it sets (OpenAI's `max_tokens`,
/// `max_completion_tokens` and the Responses API's `max_output_tokens`, Anthropic's
/// `max_tokens`, Gemini's `generationConfig.maxOutputTokens`); None without one.
pub fn request_bound(body: &[u8]) -> Option<u64> {
    let json: serde_json::Value = serde_json::from_slice(body).ok()?;
    let output = ["max_tokens", "max_completion_tokens", "max_output_tokens"]
        .iter()
        .filter_map(|name| json.get(name))
        .chain(json.pointer("/generationConfig/maxOutputTokens"))
        .filter_map(serde_json::Value::as_u64)
        .max()?;
    // Far past any budget (so refused), yet exact in Redis's Lua arithmetic.
    Some((body.len() as u64 / 4).saturating_add(output).min(1 << 40))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(content_type: &str, chunks: &[&str]) -> UsageMeter {
        let mut meter = UsageMeter::new(Some(content_type.as_bytes()));
        for chunk in chunks {
            meter.feed(&bytes::Bytes::copy_from_slice(chunk.as_bytes()));
        }
        meter.finish();
        meter
    }

    /// The same text fed whole and one byte at a time.
    fn both_ways(content_type: &str, text: &str, format: UsageFormat) -> Option<u64> {
        let whole = read(content_type, &[text]).cost(format);
        let mut meter = UsageMeter::new(Some(content_type.as_bytes()));
        for b in text.as_bytes() {
            meter.feed(&bytes::Bytes::copy_from_slice(std::slice::from_ref(b)));
        }
        meter.finish();
        assert_eq!(whole, meter.cost(format), "byte by byte differs: {text}");
        whole
    }

    #[test]
    fn a_request_is_bounded_by_its_size_and_largest_output_bound() {
        let body = br#"{"model":"m","max_tokens":100,"max_completion_tokens":300,"messages":[]}"#;
        assert_eq!(request_bound(body), Some(body.len() as u64 / 4 + 300));
        let gemini = br#"{"contents":[],"generationConfig":{"maxOutputTokens":64}}"#;
        assert_eq!(request_bound(gemini), Some(gemini.len() as u64 / 4 + 64));
        assert_eq!(request_bound(br#"{"model":"m","messages":[]}"#), None);
        assert_eq!(request_bound(br#"{"max_tokens":"many"}"#), None);
        assert_eq!(request_bound(b"max_tokens=5"), None);
    }

    #[test]
    fn openai_chat_completion_whole() {
        let body = r#"{"id":"c1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"the \"usage\": {\"total_tokens\": 999} is text"}}],"usage":{"prompt_tokens":9,"completion_tokens":12,"total_tokens":21}}"#;
        assert_eq!(
            both_ways("application/json", body, UsageFormat::OpenAi),
            Some(21)
        );
    }

    #[test]
    fn openai_stream_takes_the_final_usage_and_ignores_done() {
        let stream = "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n\
                      data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":7,\"total_tokens\":12}}\r\n\r\n\
                      data: [DONE]\n\n";
        assert_eq!(
            both_ways("text/event-stream", stream, UsageFormat::OpenAi),
            Some(12)
        );
    }

    #[test]
    fn openai_responses_api_completed_event() {
        let stream = "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"usage\":null}}\n\n\
                      event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"r\",\"usage\":{\"input_tokens\":3,\"output_tokens\":4,\"total_tokens\":7}}}\n\n";
        assert_eq!(
            both_ways(
                "text/event-stream; charset=utf-8",
                stream,
                UsageFormat::OpenAi
            ),
            Some(7)
        );
    }

    #[test]
    fn anthropic_stream_reads_output_as_cumulative() {
        let stream = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n\
                      event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"Hello\"}}\n\n\
                      event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":10}}\n\n\
                      event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\n\n\
                      event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
        assert_eq!(
            both_ways("text/event-stream", stream, UsageFormat::Anthropic),
            Some(40)
        );
    }

    #[test]
    fn anthropic_whole_message() {
        let body = r#"{"id":"m","type":"message","content":[{"type":"text","text":"hi"}],"usage":{"input_tokens":10,"output_tokens":32}}"#;
        assert_eq!(
            both_ways("application/json", body, UsageFormat::Anthropic),
            Some(42)
        );
    }

    #[test]
    fn gemini_whole_streamed_and_as_an_array() {
        let body = r#"{"candidates":[{"content":{"parts":[{"text":"x"}]}}],"usageMetadata":{"promptTokenCount":4,"candidatesTokenCount":6,"totalTokenCount":10}}"#;
        assert_eq!(
            both_ways("application/json", body, UsageFormat::Gemini),
            Some(10)
        );
        let stream = "data: {\"usageMetadata\":{\"totalTokenCount\":5}}\r\n\r\ndata: {\"usageMetadata\":{\"totalTokenCount\":11}}\r\n\r\n";
        assert_eq!(
            both_ways("text/event-stream", stream, UsageFormat::Gemini),
            Some(11)
        );
        let array =
            r#"[{"usageMetadata":{"totalTokenCount":3}},{"usageMetadata":{"totalTokenCount":8}}]"#;
        assert_eq!(
            both_ways("application/json", array, UsageFormat::Gemini),
            Some(8)
        );
    }

    #[test]
    fn data_split_over_lines_is_one_json_text() {
        let stream = "data: {\"usage\":\ndata: {\"total_tokens\":\ndata: 33}}\n\n";
        assert_eq!(
            both_ways("text/event-stream", stream, UsageFormat::OpenAi),
            Some(33)
        );
    }

    #[test]
    fn nothing_usable_is_none() {
        for (content_type, body) in [
            ("application/json", r#"{"usage":{"total_tokens":"12"}}"#),
            ("application/json", r#"{"usage":{"total_tokens":1.5}}"#),
            ("application/json", r#"{"usage":{"total_tokens":-3}}"#),
            (
                "application/json",
                r#"{"choices":[{"usage":{"total_tokens":4}}]}"#,
            ),
            ("application/json", r#"{"usage":{"total_tokens":"#),
            (
                "application/json",
                "not json at all {\"usage\":{\"total_tokens\":5}}",
            ),
            (
                "text/event-stream",
                "data: {\"choices\":[]}\n\ndata: [DONE]\n\n",
            ),
            (
                "text/event-stream",
                ": comment {\"usage\":{\"total_tokens\":5}}\n\n",
            ),
        ] {
            assert_eq!(
                both_ways(content_type, body, UsageFormat::OpenAi),
                None,
                "{body}"
            );
        }
    }

    #[test]
    fn a_number_at_the_end_of_an_event_counts_and_later_text_is_ignored() {
        // The JSON text ends with the number: the blank line ends it.
        let stream = "data: {\"usageMetadata\":{\"totalTokenCount\":7}}\n\n";
        assert_eq!(
            both_ways("text/event-stream", stream, UsageFormat::Gemini),
            Some(7)
        );
        let body = r#"{"usage":{"total_tokens":4}} {"usage":{"total_tokens":99}}"#;
        assert_eq!(
            both_ways("application/json", body, UsageFormat::OpenAi),
            Some(4)
        );
    }

    #[test]
    fn deep_and_long_keys_are_skipped_without_losing_the_path() {
        let deep = "[".repeat(100) + &"]".repeat(100);
        let long_key = "k".repeat(500);
        let body = format!(
            r#"{{"a":{deep},"{long_key}":{{"total_tokens":5}},"usage":{{"x":"y\"z","total_tokens":17}}}}"#
        );
        assert_eq!(
            both_ways("application/json", &body, UsageFormat::OpenAi),
            Some(17)
        );
    }
}
