//! The push scanner over one JSON text that records the integers at the usage paths of the
//! three formats (OpenAI, Anthropic, Gemini), keeping only the keys on the current path.

/// Object keys longer than this match no usage path (they are skipped, not kept).
const MAX_KEY: usize = 32;
/// Nesting deeper than this is scanned but matches no usage path.
const MAX_DEPTH: usize = 16;

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
    // Anthropic's prompt caching (DESIGN §21): tokens written to and read from the cache
    // are input tokens too.
    (
        &["usage", "cache_creation_input_tokens"],
        Slot::AnthropicCacheWrite,
    ),
    (
        &["message", "usage", "cache_creation_input_tokens"],
        Slot::AnthropicCacheWrite,
    ),
    (
        &["usage", "cache_read_input_tokens"],
        Slot::AnthropicCacheRead,
    ),
    (
        &["message", "usage", "cache_read_input_tokens"],
        Slot::AnthropicCacheRead,
    ),
    // Gemini, whole or streamed.
    (&["usageMetadata", "totalTokenCount"], Slot::GeminiTotal),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Slot {
    OpenAiTotal,
    AnthropicInput,
    AnthropicOutput,
    AnthropicCacheWrite,
    AnthropicCacheRead,
    GeminiTotal,
}

/// The number of `Slot`s.
pub(super) const SLOTS: usize = 6;

/// What a body reported, by `Slot`.
pub(super) type Found = [Option<u64>; SLOTS];

/// A push scanner over one JSON text that records the integers at `PATHS`. Malformed
/// input stops it (nothing more is recorded) rather than guessing.
#[derive(Debug)]
pub(super) struct Scanner {
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
    /// Whether the text has ended (or broken off): nothing more is read.
    pub(super) fn stopped(&self) -> bool {
        self.state == State::Stopped
    }

    pub(super) fn feed(&mut self, bytes: &[u8], found: &mut Found) {
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

    fn end_number(&mut self, found: &mut Found) {
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
