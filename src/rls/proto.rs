//! The messages of `envoy.service.ratelimit.v3` that ShouldRateLimit reads and writes, in
//! protobuf's wire format by hand: five small messages do not need a code generator (and
//! its build time, see the README), and unknown fields are skipped as protobuf requires.
//!
//! The request comes from whoever reaches the listener: any bytes decode to a message or
//! to `Malformed`, never a panic, and a repeated field's vector is sized by counting its
//! fields first, so no capacity exceeds the input's length (property-tested below).

/// `RateLimitRequest`.
#[derive(Debug, Default, PartialEq)]
pub struct Request {
    pub domain: String,
    pub descriptors: Vec<Descriptor>,
    /// 0 when unset. A uint32: a varint beyond it is malformed, not cut to its low bits.
    pub hits_addend: u32,
}

/// `envoy.extensions.common.ratelimit.v3.RateLimitDescriptor`.
#[derive(Debug, Default, PartialEq)]
pub struct Descriptor {
    pub entries: Vec<(String, String)>,
    /// `limit`: (requests_per_unit, unit).
    pub limit: Option<(u32, Unit)>,
    /// `hits_addend` (a UInt64Value: unset is not 0).
    pub hits_addend: Option<u64>,
}

/// `RateLimitResponse.RateLimit.Unit` and `envoy.type.v3.RateLimitUnit` (same numbers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Unknown = 0,
    Second = 1,
    Minute = 2,
    Hour = 3,
    Day = 4,
    Month = 5,
    Year = 6,
    Week = 7,
}

impl Unit {
    pub fn seconds(self) -> Option<u64> {
        Some(match self {
            Unit::Unknown => return None,
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 7 * 86_400,
            Unit::Month => 30 * 86_400,
            Unit::Year => 365 * 86_400,
        })
    }

    pub fn of_seconds(seconds: u64) -> Unit {
        [
            Unit::Second,
            Unit::Minute,
            Unit::Hour,
            Unit::Day,
            Unit::Week,
            Unit::Month,
            Unit::Year,
        ]
        .into_iter()
        .find(|u| u.seconds() == Some(seconds))
        .unwrap_or(Unit::Unknown)
    }

    fn from_wire(n: u64) -> Unit {
        match n {
            1 => Unit::Second,
            2 => Unit::Minute,
            3 => Unit::Hour,
            4 => Unit::Day,
            5 => Unit::Month,
            6 => Unit::Year,
            7 => Unit::Week,
            _ => Unit::Unknown,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Ok = 1,
    OverLimit = 2,
}

/// `RateLimitResponse`.
#[derive(Debug, PartialEq)]
pub struct Response {
    pub overall_code: Code,
    pub statuses: Vec<Status>,
}

/// `RateLimitResponse.DescriptorStatus`.
#[derive(Debug, PartialEq)]
pub struct Status {
    pub code: Code,
    /// (name, requests_per_unit, unit).
    pub current_limit: Option<(String, u32, Unit)>,
    pub limit_remaining: u32,
    pub duration_until_reset_ms: Option<u64>,
}

/// Why bytes are not a valid message.
#[derive(Debug, PartialEq, Eq)]
pub struct Malformed(pub &'static str);

struct Reader<'a>(&'a [u8]);

enum Field<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Fixed,
}

impl<'a> Reader<'a> {
    fn varint(&mut self) -> Result<u64, Malformed> {
        let mut out = 0u64;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = self.0.split_first().ok_or(Malformed("truncated varint"))?;
            self.0 = rest;
            out |= u64::from(b & 0x7f) << shift;
            if b < 0x80 {
                return Ok(out);
            }
        }
        Err(Malformed("varint too long"))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        if n > self.0.len() {
            return Err(Malformed("truncated field"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    /// The next (field number, value), or None at the end.
    fn next(&mut self) -> Result<Option<(u64, Field<'a>)>, Malformed> {
        if self.0.is_empty() {
            return Ok(None);
        }
        let tag = self.varint()?;
        let field = match tag & 7 {
            0 => Field::Varint(self.varint()?),
            1 => {
                self.take(8)?;
                Field::Fixed
            }
            2 => {
                let len = usize::try_from(self.varint()?).map_err(|_| Malformed("length"))?;
                Field::Bytes(self.take(len)?)
            }
            5 => {
                self.take(4)?;
                Field::Fixed
            }
            _ => return Err(Malformed("unsupported wire type")),
        };
        if tag >> 3 == 0 {
            return Err(Malformed("field number 0"));
        }
        Ok(Some((tag >> 3, field)))
    }
}

fn text(bytes: &[u8]) -> Result<String, Malformed> {
    String::from_utf8(bytes.to_vec()).map_err(|_| Malformed("a string is not UTF-8"))
}

/// How many fields numbered `field` a message's bytes hold, read up to its end or its first
/// error: a vector of exactly that capacity holds them all, and it is at most half the
/// bytes' length (a field takes two bytes at least).
fn count(bytes: &[u8], field: u64) -> usize {
    let mut r = Reader(bytes);
    let mut n = 0;
    while let Ok(Some((f, _))) = r.next() {
        n += usize::from(f == field);
    }
    n
}

impl Request {
    pub fn decode(bytes: &[u8]) -> Result<Request, Malformed> {
        let mut out = Request {
            descriptors: Vec::with_capacity(count(bytes, 2)),
            ..Request::default()
        };
        let mut r = Reader(bytes);
        while let Some((n, field)) = r.next()? {
            match (n, field) {
                (1, Field::Bytes(b)) => out.domain = text(b)?,
                (2, Field::Bytes(b)) => out.descriptors.push(Descriptor::decode(b)?),
                (3, Field::Varint(v)) => {
                    out.hits_addend = u32::try_from(v)
                        .map_err(|_| Malformed("hits_addend is out of range for a uint32"))?;
                }
                (1..=3, _) => return Err(Malformed("wrong wire type")),
                _ => {}
            }
        }
        Ok(out)
    }
}

impl Descriptor {
    fn decode(bytes: &[u8]) -> Result<Descriptor, Malformed> {
        let mut out = Descriptor {
            entries: Vec::with_capacity(count(bytes, 1)),
            ..Descriptor::default()
        };
        let mut r = Reader(bytes);
        while let Some((n, field)) = r.next()? {
            match (n, field) {
                (1, Field::Bytes(b)) => {
                    let (mut key, mut value) = (String::new(), String::new());
                    let mut e = Reader(b);
                    while let Some((n, field)) = e.next()? {
                        match (n, field) {
                            (1, Field::Bytes(b)) => key = text(b)?,
                            (2, Field::Bytes(b)) => value = text(b)?,
                            (1 | 2, _) => return Err(Malformed("wrong wire type")),
                            _ => {}
                        }
                    }
                    out.entries.push((key, value));
                }
                (2, Field::Bytes(b)) => {
                    let (mut rpu, mut unit) = (0u32, Unit::Unknown);
                    let mut l = Reader(b);
                    while let Some((n, field)) = l.next()? {
                        match (n, field) {
                            (1, Field::Varint(v)) => rpu = v as u32,
                            (2, Field::Varint(v)) => unit = Unit::from_wire(v),
                            (1 | 2, _) => return Err(Malformed("wrong wire type")),
                            _ => {}
                        }
                    }
                    out.limit = Some((rpu, unit));
                }
                (3, Field::Bytes(b)) => {
                    let mut value = 0;
                    let mut w = Reader(b);
                    while let Some((n, field)) = w.next()? {
                        match (n, field) {
                            (1, Field::Varint(v)) => value = v,
                            (1, _) => return Err(Malformed("wrong wire type")),
                            _ => {}
                        }
                    }
                    out.hits_addend = Some(value);
                }
                (1..=3, _) => return Err(Malformed("wrong wire type")),
                _ => {}
            }
        }
        Ok(out)
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_uint(out: &mut Vec<u8>, field: u64, v: u64) {
    if v != 0 {
        put_varint(out, field << 3);
        put_varint(out, v);
    }
}

fn put_bytes(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    put_varint(out, (field << 3) | 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

impl Response {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + 32 * self.statuses.len());
        put_uint(&mut out, 1, self.overall_code as u64);
        let mut status = Vec::with_capacity(32);
        for s in &self.statuses {
            status.clear();
            put_uint(&mut status, 1, s.code as u64);
            if let Some((name, rpu, unit)) = &s.current_limit {
                let mut limit = Vec::with_capacity(8 + name.len());
                put_uint(&mut limit, 1, u64::from(*rpu));
                put_uint(&mut limit, 2, *unit as u64);
                if !name.is_empty() {
                    put_bytes(&mut limit, 3, name.as_bytes());
                }
                put_bytes(&mut status, 2, &limit);
            }
            put_uint(&mut status, 3, u64::from(s.limit_remaining));
            if let Some(ms) = s.duration_until_reset_ms {
                let mut d = Vec::with_capacity(12);
                put_uint(&mut d, 1, ms / 1000);
                put_uint(&mut d, 2, (ms % 1000) * 1_000_000);
                put_bytes(&mut status, 4, &d);
            }
            put_bytes(&mut out, 2, &status);
        }
        out
    }

    /// Decodes what `encode` writes (tests and clients).
    pub fn decode(bytes: &[u8]) -> Result<Response, Malformed> {
        let mut r = Reader(bytes);
        let mut out = Response {
            overall_code: Code::Ok,
            statuses: Vec::new(),
        };
        let code = |v: u64| if v == 2 { Code::OverLimit } else { Code::Ok };
        while let Some((n, field)) = r.next()? {
            match (n, field) {
                (1, Field::Varint(v)) => out.overall_code = code(v),
                (2, Field::Bytes(b)) => {
                    let mut s = Status {
                        code: Code::Ok,
                        current_limit: None,
                        limit_remaining: 0,
                        duration_until_reset_ms: None,
                    };
                    let mut sr = Reader(b);
                    while let Some((n, field)) = sr.next()? {
                        match (n, field) {
                            (1, Field::Varint(v)) => s.code = code(v),
                            (2, Field::Bytes(b)) => {
                                let (mut name, mut rpu, mut unit) =
                                    (String::new(), 0, Unit::Unknown);
                                let mut lr = Reader(b);
                                while let Some((n, field)) = lr.next()? {
                                    match (n, field) {
                                        (1, Field::Varint(v)) => rpu = v as u32,
                                        (2, Field::Varint(v)) => unit = Unit::from_wire(v),
                                        (3, Field::Bytes(b)) => name = text(b)?,
                                        _ => {}
                                    }
                                }
                                s.current_limit = Some((name, rpu, unit));
                            }
                            (3, Field::Varint(v)) => s.limit_remaining = v as u32,
                            (4, Field::Bytes(b)) => {
                                let (mut secs, mut nanos) = (0, 0);
                                let mut dr = Reader(b);
                                while let Some((n, field)) = dr.next()? {
                                    match (n, field) {
                                        (1, Field::Varint(v)) => secs = v,
                                        (2, Field::Varint(v)) => nanos = v,
                                        _ => {}
                                    }
                                }
                                s.duration_until_reset_ms = Some(secs * 1000 + nanos / 1_000_000);
                            }
                            _ => {}
                        }
                    }
                    out.statuses.push(s);
                }
                _ => {}
            }
        }
        Ok(out)
    }
}

/// Encodes a request (tests and the benchmark's client).
pub fn encode_request(req: &Request) -> Vec<u8> {
    let mut out = Vec::new();
    if !req.domain.is_empty() {
        put_bytes(&mut out, 1, req.domain.as_bytes());
    }
    for d in &req.descriptors {
        let mut desc = Vec::new();
        for (k, v) in &d.entries {
            let mut e = Vec::new();
            put_bytes(&mut e, 1, k.as_bytes());
            put_bytes(&mut e, 2, v.as_bytes());
            put_bytes(&mut desc, 1, &e);
        }
        if let Some((rpu, unit)) = d.limit {
            let mut l = Vec::new();
            put_uint(&mut l, 1, u64::from(rpu));
            put_uint(&mut l, 2, unit as u64);
            put_bytes(&mut desc, 2, &l);
        }
        if let Some(h) = d.hits_addend {
            let mut w = Vec::new();
            put_uint(&mut w, 1, h);
            put_bytes(&mut desc, 3, &w);
        }
        put_bytes(&mut out, 2, &desc);
    }
    put_uint(&mut out, 3, u64::from(req.hits_addend));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_survives_the_round_trip() {
        let req = Request {
            domain: "edge".into(),
            descriptors: vec![
                Descriptor {
                    entries: vec![("k".into(), "v".into()), ("user".into(), "é".into())],
                    limit: Some((7, Unit::Hour)),
                    hits_addend: Some(0),
                },
                Descriptor::default(),
            ],
            hits_addend: 3,
        };
        assert_eq!(Request::decode(&encode_request(&req)), Ok(req));
    }

    #[test]
    fn a_response_survives_the_round_trip() {
        let resp = Response {
            overall_code: Code::OverLimit,
            statuses: vec![Status {
                code: Code::OverLimit,
                current_limit: Some(("per_user".into(), 10, Unit::Minute)),
                limit_remaining: 0,
                duration_until_reset_ms: Some(12_345),
            }],
        };
        assert_eq!(Response::decode(&resp.encode()), Ok(resp));
    }

    #[test]
    fn garbage_is_malformed_not_a_panic() {
        for bytes in [
            &[0x0a, 0x05, b'a'][..],
            &[0xff; 11],
            &[0x0b],
            &[0x12, 0x02, 0x0a, 0x09],
        ] {
            assert!(Request::decode(bytes).is_err(), "{bytes:?}");
        }
        // Unknown fields are skipped.
        assert_eq!(
            Request::decode(&[0x20, 0x01, 0x0a, 0x01, b'd']).map(|r| r.domain),
            Ok("d".to_owned())
        );
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        fn unit() -> impl Strategy<Value = Unit> {
            prop_oneof![
                Just(Unit::Unknown),
                Just(Unit::Second),
                Just(Unit::Minute),
                Just(Unit::Hour),
                Just(Unit::Day),
                Just(Unit::Week),
                Just(Unit::Month),
                Just(Unit::Year),
            ]
        }

        fn descriptor() -> impl Strategy<Value = Descriptor> {
            (
                proptest::collection::vec((".{0,6}", ".{0,6}"), 0..4),
                proptest::option::of((any::<u32>(), unit())),
                proptest::option::of(any::<u64>()),
            )
                .prop_map(|(entries, limit, hits_addend)| Descriptor {
                    entries,
                    limit,
                    hits_addend,
                })
        }

        fn request() -> impl Strategy<Value = Request> {
            (
                ".{0,8}",
                proptest::collection::vec(descriptor(), 0..5),
                any::<u32>(),
            )
                .prop_map(|(domain, descriptors, hits_addend)| Request {
                    domain,
                    descriptors,
                    hits_addend,
                })
        }

        /// Bytes near a request's: its encoding cut short, with bytes changed, inserted or
        /// appended; or any bytes at all.
        fn bytes() -> impl Strategy<Value = Vec<u8>> {
            prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..256),
                (
                    request(),
                    any::<prop::sample::Index>(),
                    proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
                    proptest::collection::vec(any::<u8>(), 0..16),
                )
                    .prop_map(|(req, cut, changes, tail)| {
                        let mut b = encode_request(&req);
                        if !b.is_empty() {
                            for (at, byte) in changes {
                                let i = at.index(b.len());
                                b[i] = byte;
                            }
                            b.truncate(cut.index(b.len() + 1));
                        }
                        b.extend_from_slice(&tail);
                        b
                    }),
            ]
        }

        /// What a decoded request holds, against the bytes it came from: every vector's
        /// capacity and the strings' bytes together within their length.
        fn within(req: &Request, len: usize) -> Result<(), TestCaseError> {
            prop_assert!(req.descriptors.capacity() <= len / 2);
            let mut strings = req.domain.capacity();
            let mut entries = 0;
            for d in &req.descriptors {
                prop_assert!(d.entries.capacity() <= len / 2);
                entries += d.entries.capacity();
                for (k, v) in &d.entries {
                    strings += k.capacity() + v.capacity();
                }
            }
            prop_assert!(entries + req.descriptors.capacity() <= len / 2);
            prop_assert!(strings <= len);
            Ok(())
        }

        proptest! {
            #[test]
            fn any_bytes_decode_to_a_message_or_an_error_within_their_size(b in bytes()) {
                if let Ok(req) = Request::decode(&b) {
                    within(&req, b.len())?;
                }
                let _ = Response::decode(&b);
            }

            #[test]
            fn a_request_survives_the_round_trip_within_its_size(req in request()) {
                let b = encode_request(&req);
                let back = Request::decode(&b).map_err(|e| TestCaseError::fail(e.0))?;
                within(&back, b.len())?;
                prop_assert_eq!(back, req);
            }
        }
    }
}
