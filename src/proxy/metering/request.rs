//! The request side of metering (DESIGN §12, §17, §21): a metered request's body read whole
//! before the decision (or held until it ends: the `body` group of the context), its bound,
//! and a stream asked for its usage.

use bytes::Bytes;
use pingora::http::RequestHeader;
use pingora::prelude::*;

use crate::config::{Config, Metering, Route, UsageFormat};

/// The request's body as metering and `max_request_body` see it.
#[derive(Default)]
pub struct Body {
    /// A metered request's body, read whole before the decision and sent on as this
    /// (DESIGN §12, §17): what Pingora replays of it from its retry buffer is replaced.
    pub whole: Option<Bytes>,
    /// A body of unknown length on a `usage = "openai"` route, held until it ends to be
    /// asked for its usage (DESIGN §17).
    pub held: Option<Vec<u8>>,
    /// The route's `max_request_body` (0 = unlimited) and the body bytes seen so far.
    pub limit: u64,
    seen: u64,
}

impl Body {
    /// `request_body_filter`: a body read whole goes instead of what Pingora replays; a
    /// body of unknown length is stopped at the limit, or held until it ends.
    pub fn filter(&mut self, body: &mut Option<Bytes>, end_of_stream: bool) -> Result<()> {
        if let Some(whole) = &self.whole {
            // Read before the decision: what Pingora replays (the last 64 KiB or less of
            // it, once per upstream tried) is the end of this; the whole goes instead.
            if body.is_some() {
                *body = Some(whole.clone());
            }
            return Ok(());
        }
        // A chunked (or HTTP/2) body has no length up front: stop it at the limit.
        if let (Some(chunk), 1..) = (body.as_ref(), self.limit) {
            self.seen += chunk.len() as u64;
            if self.seen > self.limit {
                return Error::e_explain(ErrorType::HTTPStatus(413), "max_request_body exceeded");
            }
        }
        if let Some(held) = &mut self.held {
            hold_body(held, body, end_of_stream)?;
        }
        // An empty chunk is a chunked body's last-chunk: written at the end it would be a
        // second one after Pingora's own (DESIGN §21), which a keep-alive upstream reads as
        // another request. Nothing at all ends the body once.
        if end_of_stream && body.as_ref().is_some_and(Bytes::is_empty) {
            *body = None;
        }
        Ok(())
    }
}

/// What a route's policies need of a request's body before it is sent on.
pub struct BodyNeeds {
    /// `reserve = "request"`: its bound, before the decision, and the output bound written
    /// into a body that sets none (DESIGN §12, §21).
    pub bound: Option<Written>,
    /// `usage = "openai"`: a stream asked for its usage (DESIGN §17).
    pub usage: bool,
}

impl BodyNeeds {
    pub fn of(config: &Config, route: &Route) -> BodyNeeds {
        let mut needs = BodyNeeds {
            bound: None,
            usage: false,
        };
        for &id in &route.policies {
            let policy = &config.policies[id];
            let format = match policy.metering {
                Some(Metering::Usage(format)) => Some(format),
                _ => None,
            };
            if let Some(most) = policy.reserve_request {
                // Every policy of the route holds the same bound: the smallest is written.
                let tokens = needs.bound.map_or(most, |w| w.tokens.min(most));
                let format = needs.bound.and_then(|w| w.format).or(format);
                needs.bound = Some(Written { tokens, format });
            }
            needs.usage |= format == Some(UsageFormat::OpenAi);
        }
        needs
    }
}

/// The output bound written into a request that sets none (`max_reserve`), and the format
/// that names its field (none: read as OpenAI's).
#[derive(Clone, Copy)]
pub struct Written {
    pub tokens: u64,
    pub format: Option<UsageFormat>,
}

/// The most of a metered body read whole (DESIGN §12, §17); a larger one gets 413.
const BOUND_BODY_LIMIT: u64 = 1 << 20;
/// The most of a body read before the upstream request that Pingora sends on to it (its
/// retry buffer).
const REPLAYED_BODY_LIMIT: u64 = 64 * 1024;

/// A metered request's body, as read before the decision.
pub enum RequestBody {
    Whole(Bytes),
    Empty,
    /// Of a length not known up front (chunked, or HTTP/2 without content-length): not
    /// read before the decision (see `read_body`).
    Unknown,
    /// Over 1 MiB, or one that could not be sent on once read: 413.
    TooLarge,
}

/// Reads a metered request's body whole, up to 1 MiB, before the decision (DESIGN §12,
/// §17); `request_body_filter` sends it on.
///
/// Pingora sends on what was read before the upstream request from its retry buffer, which
/// holds 64 KiB, and only when it holds everything read since it was enabled. So it is
/// enabled once at most 64 KiB of the body are left: it then holds the body's end, the
/// one chunk Pingora sends, which `request_body_filter` replaces with the whole. (Each read
/// takes at most 64 KiB; only the bytes that came with a header larger than that could end
/// the body in the first read: that body cannot be sent on, and gets 413.) A body of
/// unknown length cannot be read so: its end is known only once read.
pub async fn read_body(session: &mut Session) -> Result<RequestBody> {
    let req = session.req_header();
    if req.headers.contains_key(http::header::TRANSFER_ENCODING) {
        return Ok(RequestBody::Unknown);
    }
    let Some(length) = content_length(req) else {
        // HTTP/1.1 without either header has no body; HTTP/2 may send one without.
        return Ok(match session.is_body_empty() {
            true => RequestBody::Empty,
            false => RequestBody::Unknown,
        });
    };
    if length > BOUND_BODY_LIMIT {
        return Ok(RequestBody::TooLarge);
    }
    if length == 0 {
        return Ok(RequestBody::Empty);
    }
    let expects = req.headers.get(http::header::EXPECT);
    if expects.is_some_and(|e| e.as_bytes().eq_ignore_ascii_case(b"100-continue")) {
        // The body is read here, not by the upstream: the client is told to send it.
        session.write_continue_response().await?;
    }
    let mut body = Vec::with_capacity(length as usize);
    let mut buffering = false;
    loop {
        if !buffering && length - body.len() as u64 <= REPLAYED_BODY_LIMIT {
            session.enable_retry_buffering();
            buffering = true;
        }
        match session.read_request_body().await? {
            Some(chunk) => body.extend_from_slice(&chunk),
            None => break,
        }
        if body.len() as u64 > length {
            return Ok(RequestBody::TooLarge);
        }
    }
    if body.len() as u64 != length || session.get_retry_buffer().is_none() {
        return Ok(RequestBody::TooLarge);
    }
    Ok(RequestBody::Whole(Bytes::from(body)))
}

/// Holds a body of unknown length on a `usage = "openai"` route until it ends, then sends
/// it whole, asked for its usage (DESIGN §17); over 1 MiB it is refused as a metered body.
fn hold_body(held: &mut Vec<u8>, body: &mut Option<Bytes>, end_of_stream: bool) -> Result<()> {
    if let Some(chunk) = body.take() {
        if (held.len() + chunk.len()) as u64 > BOUND_BODY_LIMIT {
            return Error::e_explain(ErrorType::HTTPStatus(413), "metered body over 1 MiB");
        }
        held.extend_from_slice(&chunk);
    }
    if !end_of_stream {
        // Nothing to send yet (None would end the upstream's body).
        *body = Some(Bytes::new());
        return Ok(());
    }
    // Taken, not dropped: a retried upstream is sent the replayed body, asked again.
    let whole = std::mem::take(held);
    *body = Some(match ask_for_usage(&whole) {
        Some(asked) => Bytes::from(asked),
        None => Bytes::from(whole),
    });
    Ok(())
}

/// The declared body length, if any (Pingora has already rejected malformed values).
pub fn content_length(req: &RequestHeader) -> Option<u64> {
    req.headers
        .get(http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// A field that bounds or multiplies a request's output, not written as a plain
/// non-negative integer, or written twice (DESIGN §21): the 400's detail names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadBound(pub &'static str);

/// The output bounds and multipliers of the top level (OpenAI's `max_tokens`,
/// `max_completion_tokens`, the Responses API's `max_output_tokens`, Anthropic's
/// `max_tokens`; `n` and `best_of`), Gemini's config in both spellings, then what tells
/// the formats apart (where a bound is written).
const TOP: [&str; 11] = [
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "n",
    "best_of",
    "generationConfig",
    "generation_config",
    "messages",
    "prompt",
    "input",
    "contents",
];
const GENERATION_CONFIG: usize = 5;
const GENERATION_CONFIG_SNAKE: usize = 6;
const MESSAGES: usize = 7;
const PROMPT: usize = 8;
const INPUT: usize = 9;
const CONTENTS: usize = 10;
/// In Gemini's config: the output bound, then the candidates (a multiplier).
const GEMINI: [&str; 4] = [
    "maxOutputTokens",
    "max_output_tokens",
    "candidateCount",
    "candidate_count",
];

/// A request's bound, and its body rewritten when an output bound was written into it.
#[derive(Debug, PartialEq, Eq)]
pub struct Bounded {
    pub bound: u64,
    pub body: Option<Vec<u8>>,
}

/// `reserve = "request"` (DESIGN §12, §21): a JSON request's upper bound on the tokens it
/// may cost, its bytes / 4 for the input plus its output bound times the most outputs it
/// asks for (`n`, `best_of`, Gemini's `candidateCount`). A request that sets no output
/// bound gets one written into it (`written`, in the field its format reads), so the
/// upstream cannot produce more than is held. A bound or multiplier that is not a plain
/// non-negative integer (`"400"`, `4e2`, `400.0`, `-1`) or is written twice is refused:
/// a lenient upstream would read it. Ok(None): not a JSON object, so nothing to bound.
///
/// The body is read as `ask_for_usage` reads it (the top level walked, so no depth hides a
/// bound; a byte order mark, UTF-16 or UTF-32 decoded).
pub fn request_bound(body: &[u8], written: Written) -> Result<Option<Bounded>, BadBound> {
    let Some(text) = json_text(body) else {
        return Ok(None);
    };
    let Some((found, last_end, seen)) = top_level(&text, TOP) else {
        return Ok(None);
    };
    let mut numbers = [None; 5];
    for (i, name) in TOP.iter().enumerate().take(5) {
        numbers[i] = plain_integer(&text, &found[i], seen[i], name)?;
    }
    let mut gemini = [None; 4];
    for i in [GENERATION_CONFIG, GENERATION_CONFIG_SNAKE] {
        if seen[i] > 1 {
            return Err(BadBound(TOP[i]));
        }
        let Some(at) = &found[i] else { continue };
        let inner = &text[at.clone()];
        if let Some((inner_found, _, inner_seen)) = top_level(inner, GEMINI) {
            for (i, name) in GEMINI.iter().enumerate() {
                let value = plain_integer(inner, &inner_found[i], inner_seen[i], name)?;
                gemini[i] = gemini[i].max(value);
            }
        }
    }
    let times = [numbers[3], numbers[4], gemini[2], gemini[3]]
        .into_iter()
        .flatten()
        .fold(1, u64::max);
    let output = [numbers[0], numbers[1], numbers[2], gemini[0], gemini[1]];
    let (output, rewritten) = match output.into_iter().flatten().max() {
        Some(output) => (output, None),
        None => {
            let rewritten = write_bound(&text, &found, last_end, written)?;
            (written.tokens, Some(rewritten))
        }
    };
    let bound = (body.len() as u64 / 4).saturating_add(output.saturating_mul(times));
    // Far past any budget (so refused), yet exact in Redis's Lua arithmetic.
    Ok(Some(Bounded {
        bound: bound.min(1 << 40),
        body: rewritten,
    }))
}

/// `text` with `written.tokens` set as its output bound, in the field its format reads:
/// Gemini's `generationConfig.maxOutputTokens` (in the config the request has, or a new
/// one), the Responses API's `max_output_tokens`, completions' and Anthropic's
/// `max_tokens`, chat completions' `max_completion_tokens` (OpenAI's reasoning models
/// refuse `max_tokens`).
fn write_bound(
    text: &[u8],
    found: &Found<{ TOP.len() }>,
    last_end: usize,
    written: Written,
) -> Result<Vec<u8>, BadBound> {
    let has = |i: usize| found[i].is_some();
    let tokens = written.tokens;
    let gemini = written.format == Some(UsageFormat::Gemini)
        || has(CONTENTS)
        || has(GENERATION_CONFIG)
        || has(GENERATION_CONFIG_SNAKE);
    let mut out = Vec::with_capacity(text.len() + 48);
    if gemini {
        let configs = [GENERATION_CONFIG, GENERATION_CONFIG_SNAKE];
        let mut at = 0;
        for i in configs.into_iter().filter(|&i| has(i)) {
            let range = found[i].clone().unwrap_or_default();
            out.extend_from_slice(&text[at..range.start]);
            match &text[range.clone()] {
                b"null" => {
                    out.extend_from_slice(format!(r#"{{"maxOutputTokens":{tokens}}}"#).as_bytes())
                }
                [b'{', rest @ ..] => {
                    out.extend_from_slice(format!(r#"{{"maxOutputTokens":{tokens}"#).as_bytes());
                    if text.get(skip_ws(text, range.start + 1)) != Some(&b'}') {
                        out.push(b',');
                    }
                    out.extend_from_slice(rest);
                }
                _ => return Err(BadBound(TOP[i])),
            }
            at = range.end;
        }
        if at == 0 {
            out.extend_from_slice(&text[..last_end]);
            out.extend_from_slice(
                format!(r#","generationConfig":{{"maxOutputTokens":{tokens}}}"#).as_bytes(),
            );
            out.extend_from_slice(&text[last_end..]);
        } else {
            out.extend_from_slice(&text[at..]);
        }
        return Ok(out);
    }
    let chat = has(MESSAGES);
    let field = match written.format {
        Some(UsageFormat::Anthropic(_)) => "max_tokens",
        _ if has(INPUT) && !chat && !has(PROMPT) => "max_output_tokens",
        _ if has(PROMPT) && !chat => "max_tokens",
        _ => "max_completion_tokens",
    };
    out.extend_from_slice(&text[..last_end]);
    out.extend_from_slice(format!(r#","{field}":{tokens}"#).as_bytes());
    out.extend_from_slice(&text[last_end..]);
    Ok(out)
}

/// The value at `at` (a member `name` seen `seen` times) as a plain non-negative integer;
/// `null` or absent is none.
fn plain_integer(
    text: &[u8],
    at: &Option<std::ops::Range<usize>>,
    seen: u32,
    name: &'static str,
) -> Result<Option<u64>, BadBound> {
    let Some(at) = at else { return Ok(None) };
    let raw = &text[at.clone()];
    if raw == b"null" && seen == 1 {
        return Ok(None);
    }
    let digits = !raw.is_empty() && raw.iter().all(u8::is_ascii_digit);
    let value = std::str::from_utf8(raw)
        .ok()
        .and_then(|s| s.parse::<u64>().ok());
    match (seen, digits, value) {
        (1, true, Some(n)) => Ok(Some(n)),
        _ => Err(BadBound(name)),
    }
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
    let ([stream, stream_options, input, messages, prompt], last_end, _) = top_level(&text, names)?;
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
/// where its last member ends, and how often each name was seen; None when `text` is not
/// one object (or an empty one). Walked without recursion: containers are skipped by
/// counting brackets outside strings.
fn top_level<const N: usize>(text: &[u8], names: [&str; N]) -> Option<(Found<N>, usize, [u32; N])> {
    let mut found: Found<N> = std::array::from_fn(|_| None);
    let mut seen = [0u32; N];
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
            seen[i] += 1;
        }
        at = skip_ws(text, end);
        match text.get(at) {
            Some(b',') => at = skip_ws(text, at + 1),
            Some(b'}') => {
                return (skip_ws(text, at + 1) == text.len()).then_some((found, end, seen))
            }
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
    use crate::config::CacheWeights;

    const WRITTEN: Written = Written {
        tokens: 500,
        format: None,
    };

    /// The bound of `body` with `format`'s bound written, asserting that none is written
    /// into a body that sets one.
    fn bound_of(body: &[u8], format: Option<UsageFormat>) -> Option<u64> {
        let written = Written { format, ..WRITTEN };
        let bounded = request_bound(body, written).expect("a bound or none")?;
        Some(bounded.bound)
    }

    /// What a body without an output bound is sent as, and the bound it holds.
    fn written(body: &str, format: Option<UsageFormat>) -> (String, u64) {
        let written = Written { format, ..WRITTEN };
        let bounded = request_bound(body.as_bytes(), written)
            .expect("a bound")
            .expect("a JSON object");
        let sent = String::from_utf8(bounded.body.expect("a bound written")).expect("text");
        serde_json::from_str::<serde_json::Value>(&sent).expect("still JSON");
        (sent, bounded.bound)
    }

    #[test]
    fn a_request_without_an_output_bound_is_sent_with_the_one_it_holds() {
        let chat = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
        assert_eq!(
            written(chat, None),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":500}"#.into(),
                chat.len() as u64 / 4 + 500
            )
        );
        assert_eq!(
            written(chat, Some(UsageFormat::Anthropic(CacheWeights::ONE))).0,
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":500}"#
        );
        assert_eq!(
            written(r#"{"model":"m","prompt":"p"}"#, None).0,
            r#"{"model":"m","prompt":"p","max_tokens":500}"#
        );
        assert_eq!(
            written(r#"{"model":"m","input":"hi"}"#, None).0,
            r#"{"model":"m","input":"hi","max_output_tokens":500}"#
        );
        // Every output is held: n of them, each up to the bound written.
        let n = r#"{"n":3,"messages":[],"max_tokens":null}"#;
        assert_eq!(written(n, None).1, n.len() as u64 / 4 + 1500);
        // Gemini: in the config the request has, or a new one.
        assert_eq!(
            written(r#"{"contents":[]}"#, None).0,
            r#"{"contents":[],"generationConfig":{"maxOutputTokens":500}}"#
        );
        assert_eq!(
            written(
                r#"{"contents":[], "generationConfig": { "temperature":1 }}"#,
                None
            )
            .0,
            r#"{"contents":[], "generationConfig": {"maxOutputTokens":500, "temperature":1 }}"#
        );
        assert_eq!(
            written(r#"{"contents":[],"generation_config":{ },"x":1}"#, None).0,
            r#"{"contents":[],"generation_config":{"maxOutputTokens":500 },"x":1}"#
        );
        let (sent, bound) = written(
            r#"{"generationConfig":null,"contents":[]}"#,
            Some(UsageFormat::Gemini),
        );
        assert_eq!(
            sent,
            r#"{"generationConfig":{"maxOutputTokens":500},"contents":[]}"#
        );
        assert_eq!(bound, 39 / 4 + 500);
        let (sent, _) = written(r#"{"generationConfig":{"candidateCount":2}}"#, None);
        assert_eq!(
            sent,
            r#"{"generationConfig":{"maxOutputTokens":500,"candidateCount":2}}"#
        );
        assert_eq!(
            request_bound(br#"{"generationConfig":"x"}"#, WRITTEN),
            Err(BadBound("generationConfig"))
        );
        // A body that sets a bound is sent as it came.
        let set = request_bound(br#"{"max_tokens":10,"messages":[]}"#, WRITTEN);
        assert!(set.is_ok_and(|b| b.is_some_and(|b| b.body.is_none())));
    }

    #[test]
    fn a_request_is_bounded_by_its_size_and_largest_output_bound() {
        let bound = |b: &[u8]| bound_of(b, None);
        let body = br#"{"model":"m","max_tokens":100,"max_completion_tokens":300,"messages":[]}"#;
        assert_eq!(bound(body), Some(body.len() as u64 / 4 + 300));
        let gemini = br#"{"contents":[],"generationConfig":{"maxOutputTokens":64}}"#;
        assert_eq!(bound(gemini), Some(gemini.len() as u64 / 4 + 64));
        assert_eq!(bound(b"max_tokens=5"), None);
        assert_eq!(bound(b"{}"), None);
        // No spelling hides a bound: any depth, UTF-16.
        let deep = format!(
            r#"{{"messages":[{}]{},"max_tokens":1000}}"#,
            "[".repeat(3000),
            "]".repeat(3000)
        );
        assert_eq!(bound(deep.as_bytes()), Some(deep.len() as u64 / 4 + 1000));
        let utf16: Vec<u8> =
            r#"{"max_tokens":700}"#.encode_utf16().flat_map(u16::to_le_bytes).collect();
        assert_eq!(bound(&utf16), Some(utf16.len() as u64 / 4 + 700));
    }

    #[test]
    fn every_output_a_request_asks_for_is_bounded() {
        let bound = |b: &[u8]| bound_of(b, None);
        let n = br#"{"n":50,"max_tokens":400,"stream":true}"#;
        assert_eq!(bound(n), Some(n.len() as u64 / 4 + 50 * 400));
        let best_of = br#"{"prompt":"p","best_of":5,"n":2,"max_tokens":10}"#;
        assert_eq!(bound(best_of), Some(best_of.len() as u64 / 4 + 5 * 10));
        let gemini = br#"{"generationConfig":{"candidateCount":4,"maxOutputTokens":100}}"#;
        assert_eq!(bound(gemini), Some(gemini.len() as u64 / 4 + 400));
        let snake = br#"{"generation_config":{"candidate_count":3,"max_output_tokens":100}}"#;
        assert_eq!(bound(snake), Some(snake.len() as u64 / 4 + 300));
    }

    #[test]
    fn a_bound_spelled_loosely_is_refused_naming_its_field() {
        for (body, field) in [
            (&br#"{"max_tokens":"40000"}"#[..], "max_tokens"),
            (br#"{"max_tokens":4e4}"#, "max_tokens"),
            (br#"{"max_tokens":40000.0}"#, "max_tokens"),
            (br#"{"max_tokens":-1}"#, "max_tokens"),
            (br#"{"max_tokens":1,"max_tokens":900}"#, "max_tokens"),
            (
                br#"{"max_completion_tokens":"many"}"#,
                "max_completion_tokens",
            ),
            (br#"{"n":"50","max_tokens":1}"#, "n"),
            (br#"{"best_of":2.5}"#, "best_of"),
            (
                br#"{"generationConfig":{"maxOutputTokens":"64"}}"#,
                "maxOutputTokens",
            ),
            (
                br#"{"generationConfig":{"candidateCount":1e1}}"#,
                "candidateCount",
            ),
            (
                br#"{"generationConfig":{},"generationConfig":{}}"#,
                "generationConfig",
            ),
            (br#"{"max_tokens":99999999999999999999999}"#, "max_tokens"),
        ] {
            assert_eq!(
                request_bound(body, WRITTEN),
                Err(BadBound(field)),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
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

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

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
