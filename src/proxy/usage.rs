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

    /// Whether more of the body can change what it reports: a whole JSON text that has
    /// ended (or broken off) reads nothing more.
    pub fn wants_more(&self) -> bool {
        match &self.body {
            Body::Json(json) => json.state != State::Stopped,
            Body::Sse(_) => true,
        }
    }

    /// Bytes of the body this meter holds (its head and, by reference, its tail).
    #[cfg(test)]
    pub(crate) fn kept(&self) -> usize {
        match &self.body {
            Body::Json(_) => 0,
            Body::Sse(sse) => sse.head.capacity() + sse.tail_len,
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
                    (input, output) => Some(input.unwrap_or(0).saturating_add(output.unwrap_or(0))),
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
///
/// The body is read as `ask_for_usage` reads it (the top level walked, so no depth hides a
/// bound; the last of repeated keys; a byte order mark, UTF-16 or UTF-32 decoded).
pub fn request_bound(body: &[u8]) -> Option<u64> {
    use serde_json::Value;
    let text = json_text(body)?;
    let names = [
        "max_tokens",
        "max_completion_tokens",
        "max_output_tokens",
        "generationConfig",
    ];
    let (found, _) = top_level(&text, names)?;
    let [tokens @ .., gemini] =
        found.map(|at| at.and_then(|at| serde_json::from_slice::<Value>(&text[at]).ok()));
    let gemini = gemini.as_ref().and_then(|g| g.get("maxOutputTokens"));
    let output = tokens
        .iter()
        .flatten()
        .chain(gemini)
        .filter_map(Value::as_u64)
        .max()?;
    // Far past any budget (so refused), yet exact in Redis's Lua arithmetic.
    Some((body.len() as u64 / 4).saturating_add(output).min(1 << 40))
}

/// What `ask_for_usage` adds to a stream request that has no `stream_options`.
const INCLUDE_USAGE: &[u8] = br#","stream_options":{"include_usage":true}"#;

/// `usage = "openai"` (DESIGN §17 "Usage is asked for"): a JSON request for a stream that
/// does not ask for its usage, rewritten to ask (`"stream_options": {"include_usage":
/// true}`, its other options kept); None when nothing is to change: not a JSON object, not
/// a stream, the usage already asked for, or a Responses API request (`input`, without the
/// `messages` of chat completions or the `prompt` of completions), which reports its usage
/// unasked and takes no `include_usage`.
///
/// The body is read as the servers behind sluice read it: escapes in keys decoded, the
/// last of repeated keys winning (Python's and JavaScript's `JSON.parse`, serde), `stream`
/// true also when spelled as lax parsers take it (pydantic: `1`, `"true"`, `"yes"`, …),
/// a UTF-8 byte order mark skipped and UTF-16 or UTF-32 text decoded (Python's
/// `json.loads`). Only the top level is walked (so any depth is read); the rest of the
/// body is copied byte for byte, with the option set where `stream_options` was, or added
/// as the last member.
pub fn ask_for_usage(body: &[u8]) -> Option<Vec<u8>> {
    let text = json_text(body)?;
    let names = ["stream", "stream_options", "input", "messages", "prompt"];
    let ([stream, stream_options, input, messages, prompt], last_end) = top_level(&text, names)?;
    if input.is_some() && messages.is_none() && prompt.is_none() {
        return None;
    }
    let stream = stream?;
    let stream: serde_json::Value = serde_json::from_slice(&text[stream]).ok()?;
    if !truthy(&stream) {
        return None;
    }
    let mut rewritten = Vec::with_capacity(text.len() + INCLUDE_USAGE.len());
    match stream_options {
        None => {
            rewritten.extend_from_slice(&text[..last_end]);
            rewritten.extend_from_slice(INCLUDE_USAGE);
            rewritten.extend_from_slice(&text[last_end..]);
        }
        Some(at) => {
            let mut options = match serde_json::from_slice(&text[at.clone()]) {
                Ok(serde_json::Value::Object(options)) => options,
                _ => serde_json::Map::new(),
            };
            if options.get("include_usage") == Some(&serde_json::Value::Bool(true)) {
                return None;
            }
            options.insert("include_usage".into(), serde_json::Value::Bool(true));
            rewritten.extend_from_slice(&text[..at.start]);
            serde_json::to_writer(&mut rewritten, &options).ok()?;
            rewritten.extend_from_slice(&text[at.end..]);
        }
    }
    Some(rewritten)
}

/// `body` as UTF-8 JSON text, as Python's `json.loads` finds its encoding (RFC 4627 §3, a
/// byte order mark); UTF-8 is borrowed, the rest decoded. None: not decodable.
fn json_text(body: &[u8]) -> Option<std::borrow::Cow<'_, [u8]>> {
    use std::borrow::Cow;
    let utf16 = |bytes: &[u8], be: bool| {
        let units = bytes.chunks_exact(2).map(|u| {
            let pair = [u[0], u[1]];
            if be {
                u16::from_be_bytes(pair)
            } else {
                u16::from_le_bytes(pair)
            }
        });
        bytes.len().is_multiple_of(2).then_some(())?;
        let text: Result<String, _> = char::decode_utf16(units).collect();
        text.ok().map(|t| Cow::Owned(t.into_bytes()))
    };
    let utf32 = |bytes: &[u8], be: bool| {
        bytes.len().is_multiple_of(4).then_some(())?;
        let text: Option<String> = bytes
            .chunks_exact(4)
            .map(|u| {
                let quad = [u[0], u[1], u[2], u[3]];
                char::from_u32(if be {
                    u32::from_be_bytes(quad)
                } else {
                    u32::from_le_bytes(quad)
                })
            })
            .collect();
        text.map(|t| Cow::Owned(t.into_bytes()))
    };
    match body {
        [0, 0, 0xfe, 0xff, rest @ ..] => utf32(rest, true),
        [0xff, 0xfe, 0, 0, rest @ ..] => utf32(rest, false),
        [0xfe, 0xff, rest @ ..] => utf16(rest, true),
        [0xff, 0xfe, rest @ ..] => utf16(rest, false),
        [0xef, 0xbb, 0xbf, rest @ ..] => Some(Cow::Borrowed(rest)),
        [0, 0, _, _, ..] => utf32(body, true),
        [0, _, _, _, ..] => utf16(body, true),
        [_, 0, 0, 0, ..] => utf32(body, false),
        [_, 0, _, _, ..] => utf16(body, false),
        _ => Some(Cow::Borrowed(body)),
    }
}

/// Whether a `stream` value asks for a stream, as a strict or a lax (pydantic) parser
/// reads a boolean.
fn truthy(value: &serde_json::Value) -> bool {
    use serde_json::Value;
    match value {
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() == Some(1.0),
        Value::String(s) => ["1", "true", "t", "yes", "y", "on"]
            .iter()
            .any(|t| s.eq_ignore_ascii_case(t)),
        _ => false,
    }
}

/// Where in the text each of some names' value lies, if present.
type Found<const N: usize> = [Option<std::ops::Range<usize>>; N];

/// Where the last value of each of `names` lies among a JSON object's top-level members,
/// and where its last member ends; None when `text` is not one object (or an empty one).
/// Walked without recursion: containers are skipped by counting brackets outside strings.
fn top_level<const N: usize>(text: &[u8], names: [&str; N]) -> Option<(Found<N>, usize)> {
    let mut found: Found<N> = std::array::from_fn(|_| None);
    let mut at = skip_ws(text, 0);
    if text.get(at) != Some(&b'{') {
        return None;
    }
    at = skip_ws(text, at + 1);
    loop {
        if text.get(at) != Some(&b'"') {
            return None;
        }
        let key_end = string_end(text, at)?;
        let key = &text[at..key_end];
        at = skip_ws(text, key_end);
        if text.get(at) != Some(&b':') {
            return None;
        }
        let start = skip_ws(text, at + 1);
        let end = value_end(text, start)?;
        if let Some(i) = names.iter().position(|name| key_is(key, name)) {
            found[i] = Some(start..end);
        }
        at = skip_ws(text, end);
        match text.get(at) {
            Some(b',') => at = skip_ws(text, at + 1),
            Some(b'}') => return (skip_ws(text, at + 1) == text.len()).then_some((found, end)),
            _ => return None,
        }
    }
}

/// Whether the quoted JSON string `quoted` is `name`, escapes decoded.
fn key_is(quoted: &[u8], name: &str) -> bool {
    if !quoted.contains(&b'\\') {
        return &quoted[1..quoted.len() - 1] == name.as_bytes();
    }
    serde_json::from_slice::<String>(quoted).is_ok_and(|k| k == name)
}

fn skip_ws(text: &[u8], mut at: usize) -> usize {
    while matches!(text.get(at), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        at += 1;
    }
    at
}

/// Where the string opening at `start` (a `"`) ends: just past its closing quote.
fn string_end(text: &[u8], start: usize) -> Option<usize> {
    let mut at = start + 1;
    loop {
        at += memchr::memchr2(b'"', b'\\', text.get(at..)?)?;
        if text[at] == b'"' {
            return Some(at + 1);
        }
        at += 2;
    }
}

/// Where the value starting at `start` ends: past its string or its closing bracket, or
/// at the end of its literal or number.
fn value_end(text: &[u8], start: usize) -> Option<usize> {
    match text.get(start)? {
        b'"' => string_end(text, start),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut at = start;
            loop {
                match text.get(at)? {
                    b'"' => {
                        at = string_end(text, at)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(at + 1);
                        }
                    }
                    _ => {}
                }
                at += 1;
            }
        }
        _ => {
            let len = text[start..]
                .iter()
                .position(|b| matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'))
                .unwrap_or(text.len() - start);
            (len > 0).then_some(start + len)
        }
    }
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
        // No spelling hides a bound: any depth, the last of repeated keys, UTF-16.
        let deep = format!(
            r#"{{"messages":[{}]{},"max_tokens":1000}}"#,
            "[".repeat(3000),
            "]".repeat(3000)
        );
        assert_eq!(
            request_bound(deep.as_bytes()),
            Some(deep.len() as u64 / 4 + 1000)
        );
        let twice = br#"{"max_tokens":1,"max_tokens":900}"#;
        assert_eq!(request_bound(twice), Some(twice.len() as u64 / 4 + 900));
        let utf16: Vec<u8> =
            r#"{"max_tokens":700}"#.encode_utf16().flat_map(u16::to_le_bytes).collect();
        assert_eq!(request_bound(&utf16), Some(utf16.len() as u64 / 4 + 700));
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

    fn asked(body: &str) -> Option<String> {
        ask_for_usage(body.as_bytes()).map(|b| String::from_utf8(b).expect("test data"))
    }

    #[test]
    fn a_stream_without_usage_is_asked_for_it_and_the_rest_kept_byte_for_byte() {
        assert_eq!(
            asked(r#"{"model":"m", "stream":true ,"messages":[{"a":"}\"{"}] }"#).as_deref(),
            Some(
                r#"{"model":"m", "stream":true ,"messages":[{"a":"}\"{"}],"stream_options":{"include_usage":true} }"#
            )
        );
        // Set where it was, its other options kept.
        assert_eq!(
            asked(r#"{"stream":true,"stream_options":{"include_obfuscation":false},"n":1}"#)
                .as_deref(),
            Some(
                r#"{"stream":true,"stream_options":{"include_obfuscation":false,"include_usage":true},"n":1}"#
            )
        );
        assert_eq!(
            asked(r#"{"stream":true,"stream_options":{"include_usage":false}}"#).as_deref(),
            Some(r#"{"stream":true,"stream_options":{"include_usage":true}}"#)
        );
        assert_eq!(
            asked(r#"{"stream":"yes","stream_options":null}"#).as_deref(),
            Some(r#"{"stream":"yes","stream_options":{"include_usage":true}}"#)
        );
        // The last of repeated keys, escapes decoded: as a server reads it.
        assert!(asked(r#"{"stream":false,"str\u0065am":true}"#).is_some());
        assert!(asked(r#"{"stream":true,"stream":false}"#).is_none());
        assert_eq!(
            asked(r#"{"stream":true,"stream_options":{"include_usage":true},"stream_options":{}}"#)
                .as_deref(),
            Some(
                r#"{"stream":true,"stream_options":{"include_usage":true},"stream_options":{"include_usage":true}}"#
            )
        );
        // Chat completions with an `input` too are still chat completions.
        assert!(asked(r#"{"messages":[],"input":"x","stream":true}"#).is_some());
        // Any depth is walked past.
        let deep = format!(
            r#"{{"a":{}1{},"stream":1}}"#,
            "[".repeat(5000),
            "]".repeat(5000)
        );
        assert!(asked(&deep).is_some());
    }

    #[test]
    fn nothing_is_changed_unless_a_stream_lacks_its_usage() {
        for body in [
            r#"{"stream":true,"stream_options":{"include_usage":true}}"#,
            r#"{"stream":false}"#,
            r#"{"stream":null}"#,
            r#"{"stream":"no"}"#,
            r#"{"model":"m"}"#,
            r#"{}"#,
            r#"[{"stream":true}]"#,
            r#"{"stream":true"#,
            r#"{"stream":true} x"#,
            // The Responses API: usage in `response.completed`, and no include_usage.
            r#"{"model":"m","input":"hi","stream":true}"#,
            r#"{"stream":true,}"#,
            "stream=true",
            "",
        ] {
            assert_eq!(asked(body), None, "{body}");
        }
    }

    #[test]
    fn a_body_is_decoded_as_python_finds_its_encoding() {
        let text = r#"{"stream":true}"#;
        let want = Some(r#"{"stream":true,"stream_options":{"include_usage":true}}"#.to_owned());
        let mut bom = vec![0xef, 0xbb, 0xbf];
        bom.extend_from_slice(text.as_bytes());
        let utf16le: Vec<u8> = text.encode_utf16().flat_map(u16::to_le_bytes).collect();
        let utf16be: Vec<u8> = text.encode_utf16().flat_map(u16::to_be_bytes).collect();
        let utf32le: Vec<u8> = text
            .chars()
            .flat_map(|c| (c as u32).to_le_bytes())
            .collect();
        let mut utf16bom = vec![0xff, 0xfe];
        utf16bom.extend_from_slice(&utf16le);
        for body in [bom, utf16le, utf16be, utf32le, utf16bom] {
            let got = ask_for_usage(&body).map(|b| String::from_utf8(b).expect("test data"));
            assert_eq!(got, want, "{body:?}");
        }
    }

    /// The formats' streams and whole bodies, with what they cost.
    fn samples() -> Vec<(&'static str, String, UsageFormat, u64)> {
        vec![
            (
                "text/event-stream",
                "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n\
                 data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":7,\"total_tokens\":12}}\n\n\
                 data: [DONE]\n\n"
                    .into(),
                UsageFormat::OpenAi,
                12,
            ),
            (
                "text/event-stream",
                "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"usage\":null}}\n\n\
                 event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"total_tokens\":7}}}\n\n"
                    .into(),
                UsageFormat::OpenAi,
                7,
            ),
            (
                "text/event-stream",
                "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n\
                 event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":10}}\n\n\
                 event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\n\n\
                 event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"
                    .into(),
                UsageFormat::Anthropic,
                40,
            ),
            (
                "text/event-stream",
                "data: {\"usageMetadata\":{\"totalTokenCount\":5}}\n\ndata: {\"usageMetadata\":{\"totalTokenCount\":11}}\n\n"
                    .into(),
                UsageFormat::Gemini,
                11,
            ),
            (
                "application/json",
                r#"{"choices":[{"message":{"content":"the \"usage\" is"}}],"usage":{"total_tokens":21}}"#.into(),
                UsageFormat::OpenAi,
                21,
            ),
            (
                "application/json",
                r#"{"content":[{"text":"hi"}],"usage":{"input_tokens":10,"output_tokens":32}}"#.into(),
                UsageFormat::Anthropic,
                42,
            ),
            (
                "application/json",
                r#"[{"usageMetadata":{"totalTokenCount":3}},{"usageMetadata":{"totalTokenCount":8}}]"#.into(),
                UsageFormat::Gemini,
                8,
            ),
        ]
    }

    /// `sample` with `filler` events (or array elements) between its first part and the
    /// rest, and its line ends written as `eol`.
    fn with_filler(content_type: &str, sample: &str, filler: usize, eol: &str) -> String {
        if content_type == "application/json" {
            let pad = r#"{"x":"y"},"#.repeat(filler);
            return match sample.strip_prefix('[') {
                Some(rest) => format!("[{pad}{rest}"),
                None => format!(r#"{{"pad":[{pad}1],{}"#, &sample[1..]),
            };
        }
        let first = sample.find("\n\n").map_or(0, |at| at + 2);
        let event = "data: {\"choices\":[{\"delta\":{\"content\":\"filler text\"}}]}\n\n";
        let text = format!(
            "{}{}{}",
            &sample[..first],
            event.repeat(filler),
            &sample[first..]
        );
        text.replace('\n', eol)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// Any split of a stream or a whole body into chunks reads the same usage as the
        /// whole (and as the format says), past the 64 KiB kept of a stream too.
        #[test]
        fn any_split_reads_the_same_usage_as_the_whole(
            which in 0usize..7,
            filler in proptest::prop_oneof![0usize..8, 1200usize..1500],
            eol in proptest::sample::select(vec!["\n", "\r\n", "\r"]),
            cuts in proptest::collection::vec(proptest::prelude::any::<usize>(), 0..16),
        ) {
            let (content_type, sample, format, cost) = samples().swap_remove(which);
            let text = with_filler(content_type, &sample, filler, eol);
            let whole = read(content_type, &[text.as_str()]).cost(format);
            proptest::prop_assert_eq!(whole, Some(cost));
            let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (text.len() + 1)).collect();
            cuts.sort_unstable();
            let mut meter = UsageMeter::new(Some(content_type.as_bytes()));
            let mut at = 0;
            for cut in cuts.into_iter().chain([text.len()]) {
                meter.feed(&bytes::Bytes::copy_from_slice(&text.as_bytes()[at..cut]));
                at = cut;
            }
            meter.finish();
            proptest::prop_assert_eq!(meter.cost(format), whole);
        }

        /// Any bytes, in any chunks: a usage or none, never a panic; what a stream keeps
        /// stays bounded.
        #[test]
        fn any_bytes_are_read_without_panic_within_bounds(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..4096),
            chunk in 1usize..512,
        ) {
            for content_type in ["text/event-stream", "application/json"] {
                let mut meter = UsageMeter::new(Some(content_type.as_bytes()));
                for piece in bytes.chunks(chunk) {
                    meter.feed(&bytes::Bytes::copy_from_slice(piece));
                    proptest::prop_assert!(meter.kept() <= 2 * MAX_EVENT + chunk);
                }
                meter.finish();
                let _ = meter.cost(UsageFormat::Anthropic);
            }
            let _ = ask_for_usage(&bytes);
            let _ = request_bound(&bytes);
        }

        /// Asked for usage, a stream request keeps every other member as it was, and asks.
        #[test]
        fn asking_keeps_every_other_member(
            members in proptest::collection::vec(
                (
                    proptest::sample::select(vec!["model", "n", "stream", "stream_options", "x"]),
                    proptest::sample::select(vec![
                        "true", "false", "null", "1", "\"yes\"", "{}", "{\"include_usage\":true}",
                        "{\"include_usage\":false,\"k\":[1,{\"a\":\"}\"}]}", "[\"]\",[]]", "\"s\\\"\"",
                    ]),
                ),
                1..8,
            ),
        ) {
            let body = format!(
                "{{{}}}",
                members.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect::<Vec<_>>().join(",")
            );
            let sent: serde_json::Value = serde_json::from_str(&body).expect("test data");
            let stream = sent.get("stream").is_some_and(truthy);
            let has_usage = sent.pointer("/stream_options/include_usage")
                == Some(&serde_json::Value::Bool(true));
            match ask_for_usage(body.as_bytes()) {
                None => proptest::prop_assert!(!stream || has_usage, "{}", body),
                Some(asked) => {
                    proptest::prop_assert!(stream && !has_usage, "{}", body);
                    let asked: serde_json::Value = serde_json::from_slice(&asked).expect("test data");
                    proptest::prop_assert_eq!(
                        asked.pointer("/stream_options/include_usage"),
                        Some(&serde_json::Value::Bool(true))
                    );
                    for (key, value) in sent.as_object().expect("test data") {
                        if key != "stream_options" {
                            proptest::prop_assert_eq!(&asked[key], value);
                        }
                    }
                    if let Some(serde_json::Value::Object(options)) = sent.get("stream_options") {
                        for (key, value) in options {
                            if key != "include_usage" {
                                proptest::prop_assert_eq!(&asked["stream_options"][key], value);
                            }
                        }
                    }
                }
            }
        }
    }
}
