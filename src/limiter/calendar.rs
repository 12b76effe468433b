//! Calendar windows of fixed_window (DESIGN §20): the day, Monday-based week or month that
//! a time falls in, in the policy's zone, as Unix milliseconds [start, end). Days of a DST
//! change are 23 or 25 hours long, months 28 to 31 days; a midnight that a DST change skips
//! starts its day at the first instant after the gap.
//!
//! Only calendar policies come here: the epoch-aligned windows of every other period stay
//! `now - now % period`.

use jiff::civil::{Date, DateTime, Time};
use jiff::{Timestamp, ToSpan};

use crate::config::{Calendar, CalendarUnit};

/// The window [start, end) in ms that `at_ms` falls in.
pub fn window(calendar: Calendar, at_ms: u64) -> (u64, u64) {
    let tz = &calendar.zone.tz;
    let at =
        Timestamp::from_millisecond(at_ms.min(i64::MAX as u64) as i64).unwrap_or(Timestamp::MAX);
    let date = tz.to_datetime(at).date();
    let first = match calendar.unit {
        CalendarUnit::Day => date,
        CalendarUnit::Week => date
            .checked_sub(i64::from(date.weekday().to_monday_zero_offset()).days())
            .unwrap_or(date),
        CalendarUnit::Month => date.first_of_month(),
    };
    let next = match calendar.unit {
        CalendarUnit::Day => first.checked_add(1.day()),
        CalendarUnit::Week => first.checked_add(1.week()),
        CalendarUnit::Month => first.checked_add(1.month()),
    };
    let start = midnight(calendar, first);
    let end = next.map_or(u64::MAX, |next| midnight(calendar, next));
    // Never an empty window, whatever the zone's data says.
    (start.min(at_ms), end.max(at_ms + 1))
}

/// The first instant of `date` in the calendar's zone, in ms (0 before the epoch).
fn midnight(calendar: Calendar, date: Date) -> u64 {
    let tz = &calendar.zone.tz;
    // `compatible`: a midnight in a gap is the instant after it; one that occurs twice,
    // the earlier.
    tz.to_timestamp(DateTime::from_parts(date, Time::midnight()))
        .map_or(0, |t| t.as_millisecond().max(0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Zone;

    fn zone(name: &str) -> &'static Zone {
        crate::config::calendar_zone(name).expect("a known zone")
    }

    fn ms(zone: &str, text: &str) -> u64 {
        let dt: DateTime = text.parse().expect("a civil datetime");
        crate::config::calendar_zone(zone)
            .expect("a known zone")
            .tz
            .to_timestamp(dt)
            .expect("in range")
            .as_millisecond() as u64
    }

    fn cal(unit: CalendarUnit, name: &str) -> Calendar {
        Calendar {
            unit,
            zone: zone(name),
        }
    }

    const HOUR: u64 = 3_600_000;
    const DAY: u64 = 24 * HOUR;

    #[test]
    fn utc_days_are_the_epoch_aligned_days() {
        let c = cal(CalendarUnit::Day, "UTC");
        for at in [0, 1, DAY - 1, DAY, 1_774_742_399_999, 1_774_742_400_000] {
            assert_eq!(window(c, at), (at - at % DAY, at - at % DAY + DAY), "{at}");
        }
    }

    #[test]
    fn months_end_on_the_first_leap_years_included() {
        let c = cal(CalendarUnit::Month, "UTC");
        let at = ms("UTC", "2024-02-29T23:59:59.999");
        assert_eq!(
            window(c, at),
            (ms("UTC", "2024-02-01T00:00"), ms("UTC", "2024-03-01T00:00"))
        );
        assert_eq!(window(c, at).1 - window(c, at).0, 29 * DAY);
        let feb = window(c, ms("UTC", "2026-02-10T12:00"));
        assert_eq!(feb.1 - feb.0, 28 * DAY);
        let dec = window(c, ms("UTC", "2025-12-31T23:59:59.999"));
        assert_eq!(
            dec,
            (ms("UTC", "2025-12-01T00:00"), ms("UTC", "2026-01-01T00:00"))
        );
        assert_eq!(
            window(c, dec.1).0,
            dec.1,
            "the boundary starts the next month"
        );
    }

    #[test]
    fn weeks_start_on_monday() {
        let c = cal(CalendarUnit::Week, "UTC");
        // 2026-03-01 is a Sunday; 2026-03-02 a Monday.
        let sunday = window(c, ms("UTC", "2026-03-01T23:00"));
        assert_eq!(
            sunday,
            (ms("UTC", "2026-02-23T00:00"), ms("UTC", "2026-03-02T00:00"))
        );
        let monday = window(c, ms("UTC", "2026-03-02T00:00"));
        assert_eq!(
            monday,
            (ms("UTC", "2026-03-02T00:00"), ms("UTC", "2026-03-09T00:00"))
        );
    }

    #[test]
    fn dst_days_are_23_and_25_hours() {
        let c = cal(CalendarUnit::Day, "Europe/Berlin");
        // Clocks go forward on 2026-03-29 at 02:00 and back on 2026-10-25 at 03:00.
        let spring = window(c, ms("Europe/Berlin", "2026-03-29T12:00"));
        assert_eq!(spring.1 - spring.0, 23 * HOUR);
        assert_eq!(spring.0, ms("UTC", "2026-03-28T23:00"));
        assert_eq!(spring.1, ms("UTC", "2026-03-29T22:00"));
        let autumn = window(c, ms("Europe/Berlin", "2026-10-25T12:00"));
        assert_eq!(autumn.1 - autumn.0, 25 * HOUR);
        // The day before the change is a plain one, ending at local midnight (23:00 UTC).
        let before = window(c, ms("UTC", "2026-03-28T22:59:59.999"));
        assert_eq!(
            before,
            (ms("UTC", "2026-03-27T23:00"), ms("UTC", "2026-03-28T23:00"))
        );
        // A month and a week across the change are an hour short.
        let march = window(cal(CalendarUnit::Month, "Europe/Berlin"), spring.0);
        assert_eq!(march.1 - march.0, 31 * DAY - HOUR);
        let week = window(cal(CalendarUnit::Week, "Europe/Berlin"), spring.0);
        assert_eq!(week.1 - week.0, 7 * DAY - HOUR);
    }

    #[test]
    fn a_midnight_in_a_gap_starts_the_day_after_it() {
        // America/Santiago moved its clocks from 00:00 to 01:00 on 2024-09-08.
        let c = cal(CalendarUnit::Day, "America/Santiago");
        let w = window(c, ms("America/Santiago", "2024-09-08T12:00"));
        assert_eq!(w.0, ms("America/Santiago", "2024-09-08T01:00"));
        assert_eq!(w.1 - w.0, 23 * HOUR);
    }
}
