//! Calendar periods of fixed_window (DESIGN §20): `period = "1d" | "1w" | "1mo"` count
//! calendar days (from midnight), weeks (from Monday 00:00) and months (from the 1st 00:00)
//! in `timezone` (an IANA name, default "UTC"; the tz database is compiled in), DST
//! included. The window arithmetic itself lives with the algorithms (`limiter::calendar`).

use std::collections::HashMap;
use std::fmt;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use super::read::{Problems, Table};
use super::tree::Node;

/// The calendar periods, as written.
pub const CALENDAR_PERIODS: [(&str, CalendarUnit); 3] = [
    ("1d", CalendarUnit::Day),
    ("1w", CalendarUnit::Week),
    ("1mo", CalendarUnit::Month),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CalendarUnit {
    Day,
    Week,
    Month,
}

impl CalendarUnit {
    /// The period a policy reports for it (RateLimit-Policy `w`, the admin API): the
    /// longest such window without DST (a month: 31 days).
    pub fn nominal(self) -> Duration {
        const DAY: u64 = 86_400;
        Duration::from_secs(match self {
            CalendarUnit::Day => DAY,
            CalendarUnit::Week => 7 * DAY,
            CalendarUnit::Month => 31 * DAY,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            CalendarUnit::Day => "1d",
            CalendarUnit::Week => "1w",
            CalendarUnit::Month => "1mo",
        }
    }
}

/// An IANA zone, read once per name for the life of the process (there are a few hundred),
/// so a `Calendar` is a plain `Copy` value.
pub struct Zone {
    pub name: String,
    pub tz: jiff::tz::TimeZone,
}

/// The zone named `name` from the compiled-in tz database; None for an unknown name.
pub fn zone(name: &str) -> Option<&'static Zone> {
    static ZONES: OnceLock<Mutex<HashMap<String, &'static Zone>>> = OnceLock::new();
    let mut zones = ZONES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(zone) = zones.get(name) {
        return Some(zone);
    }
    let tz = jiff::tz::db().get(name).ok()?;
    let zone: &'static Zone = Box::leak(Box::new(Zone {
        name: name.to_owned(),
        tz,
    }));
    zones.insert(name.to_owned(), zone);
    Some(zone)
}

/// A fixed_window policy's calendar period: its unit and zone.
#[derive(Clone, Copy)]
pub struct Calendar {
    pub unit: CalendarUnit,
    pub zone: &'static Zone,
}

impl PartialEq for Calendar {
    fn eq(&self, other: &Calendar) -> bool {
        // Zones are interned by name.
        self.unit == other.unit && std::ptr::eq(self.zone, other.zone)
    }
}

impl Eq for Calendar {}

impl fmt::Debug for Calendar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Calendar({} in {})", self.unit.name(), self.zone.name)
    }
}

/// Whether the policy table `t` writes a calendar period.
fn written(t: &Table) -> bool {
    matches!(t.get("period").map(|n| &n.value), Some(Node::Str(s)) if CALENDAR_PERIODS.iter().any(|(name, _)| name == s))
}

/// Whether `t` writes a calendar period that `calendar` refused (reported there): any but
/// "1d" without a `timezone` on another algorithm than fixed_window, which is a rolling day.
pub(super) fn refused(t: &Table, algorithm: Option<&str>) -> bool {
    let rolling_day = matches!(t.get("period").map(|n| &n.value), Some(Node::Str(s)) if s == "1d")
        && !matches!(algorithm, None | Some("fixed_window"))
        && t.get("timezone").is_none();
    written(t) && !rolling_day
}

/// The calendar of the policy table `t`, when its `period` is one; `timezone` without one,
/// a calendar period on another algorithm than fixed_window, and unknown zones are
/// problems where they are written.
/// `algorithm` is the policy's algorithm by name (None: missing or unknown, a problem already).
pub(super) fn calendar(p: &Problems, t: &Table, algorithm: Option<&str>) -> Option<Calendar> {
    let unit = match t.get("period").map(|n| (&n.value, &n.span)) {
        Some((Node::Str(s), span)) => CALENDAR_PERIODS
            .iter()
            .find(|(name, _)| name == s)
            .map(|(_, unit)| (*unit, span.clone())),
        _ => None,
    };
    let timezone = t.string("timezone");
    let Some((unit, span)) = unit else {
        if let Some(tz) = &timezone {
            p.at(
                &t.key_span("timezone"),
                format!(
                    "`timezone` \"{}\" needs a calendar period (period = \"1d\", \"1w\" or \"1mo\")",
                    tz.value
                ),
            );
        }
        return None;
    };
    match algorithm {
        Some("fixed_window") => {}
        // A rolling day, as "1d" always was on the other algorithms.
        Some(_) if unit == CalendarUnit::Day && timezone.is_none() => return None,
        Some(other) => {
            p.at(
                &span,
                format!(
                    "calendar periods (\"1w\", \"1mo\", and \"1d\" with a `timezone`) work with fixed_window only, not {}",
                    other
                ),
            );
            return None;
        }
        None => return None,
    }
    if t.entries.iter().any(|(k, _)| k.value == "prefetch") {
        p.at(
            &t.key_span("prefetch"),
            "`prefetch` does not combine with a calendar period",
        );
    }
    let zone = match &timezone {
        None => zone("UTC"),
        Some(name) => {
            let found = zone(&name.value);
            if found.is_none() {
                p.at(
                    &name.span,
                    format!(
                        "`timezone`: unknown time zone \"{}\" (expected an IANA name such as \"UTC\" or \"Europe/Berlin\")",
                        name.value
                    ),
                );
            }
            found
        }
    };
    zone.map(|zone| Calendar { unit, zone })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zones_are_read_once_per_name() {
        let a = zone("Europe/Berlin").expect("a known zone");
        let b = zone("Europe/Berlin").expect("a known zone");
        assert!(std::ptr::eq(a, b));
        assert!(zone("UTC").is_some());
        assert!(zone("Mars/Olympus_Mons").is_none());
        let c = Calendar {
            unit: CalendarUnit::Month,
            zone: a,
        };
        assert_eq!(format!("{c:?}"), "Calendar(1mo in Europe/Berlin)");
    }
}
