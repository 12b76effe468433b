//! Server-Sent-Events streams read for their usage: the first event and the last events
//! holding a usage object, framed (WHATWG event stream) and handed to the JSON scanner.

use super::json::{Found, Scanner};

/// The most of one SSE event kept (the bound on what a stream holds).
pub(super) const MAX_EVENT: usize = 64 * 1024;
/// SSE field names longer than this are not `data`.
const MAX_FIELD: usize = 8;

/// An SSE stream, read where the three formats put their usage: the first event
/// (Anthropic's `message_start` has the input tokens) and the last events (every format's
/// final, or cumulative, usage). The chunks between pass untouched: a stream costs a
/// reference to each chunk, not a pass over its bytes. The chunks covering the last
/// `MAX_EVENT` bytes are kept (by reference) until the stream ends; then the last event
/// holding a usage object is framed and scanned.
#[derive(Debug, Default)]
pub(super) struct Sse {
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
    /// Bytes of the stream held (its head and, by reference, its tail).
    #[cfg(test)]
    pub(super) fn kept(&self) -> usize {
        self.head.capacity() + self.tail_len
    }

    pub(super) fn feed(&mut self, chunk: &bytes::Bytes, found: &mut Found) {
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
    fn read_head(&mut self, chunk: &[u8], found: &mut Found) {
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
    pub(super) fn finish(&mut self, found: &mut Found) {
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
    fn feed(&mut self, bytes: &[u8], found: &mut Found) {
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

    fn end_line(&mut self, found: &mut Found) {
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
