//! Which candidates a tuning times: all of a plan's when they are few, else a staged
//! search over the plan's choices.
//!
//! A plan's candidates are the product of its choices: an artifact per launched role and a
//! value per run-time axis. For a plan of one tiled role that is a short list, but a plan
//! that launches two tiled roles and has a run-time axis (ragged paged attention's
//! `classed_split`: a decode tiling × a prefill tiling × a split count) has hundreds, and
//! timing each one makes a tuning take minutes. Above [`FULL_SEARCH_LIMIT`] candidates a
//! plan is searched one choice at a time (coordinate descent): from its first candidate,
//! every value of one choice is timed with the others held, the fastest kept, then the
//! next choice; the sweep repeats once more if it moved (at most two). That times about
//! the *sum* of the choices' sizes instead of their product. The roles of such plans are
//! separate launches, so their times nearly add and the search finds the product's best.
//!
//! ```
//! use ejc_runtime::search::{staged_search, Point};
//! // Two choices of 20 values each, a separable cost: 400 points, about 40 timed.
//! let points: Vec<Point> = (0..400)
//!     .map(|i| Point { group: "p".into(), coords: vec![(i / 20).to_string(), (i % 20).to_string()] })
//!     .collect();
//! let cost = |i: usize| ((i / 20) as f64 - 7.0).abs() + ((i % 20) as f64 - 13.0).abs();
//! let mut timed = 0;
//! let best = staged_search(&points, |i| {
//!     timed += 1;
//!     Some(cost(i))
//! });
//! assert_eq!(best, Some(7 * 20 + 13));
//! assert!(timed <= 80);
//! ```

use std::collections::BTreeMap;

/// A plan with at most this many candidates is timed whole.
pub const FULL_SEARCH_LIMIT: usize = 64;

/// One candidate as the search sees it: its plan (`group`) and its value of each of the
/// plan's choices (`coords`, the same length within a group).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Point {
    pub group: String,
    pub coords: Vec<String>,
}

/// At most how many candidates [`staged_search`] times (a progress bar's length): a
/// small group whole, a large one at most two sweeps over its choices' values.
pub fn search_bound(points: &[Point]) -> usize {
    let mut groups: Vec<(&str, Vec<&Point>)> = Vec::new();
    for p in points {
        match groups.iter_mut().find(|(g, _)| *g == p.group) {
            Some((_, members)) => members.push(p),
            None => groups.push((&p.group, vec![p])),
        }
    }
    groups
        .iter()
        .map(|(_, members)| {
            if members.len() <= FULL_SEARCH_LIMIT {
                return members.len();
            }
            let dims = members[0].coords.len();
            let values: usize = (0..dims)
                .map(|d| members.iter().map(|p| &p.coords[d]).collect::<std::collections::BTreeSet<_>>().len())
                .sum();
            (2 * values).min(members.len())
        })
        .sum()
}

/// Time the candidates the search visits (`time(i)`: `None` for one that failed or was
/// refused), each at most once, and return the fastest's index. Groups (plans) are
/// searched in the order they first appear, and each on its own: the whole group when it
/// has at most [`FULL_SEARCH_LIMIT`] candidates, else the staged search of the module's
/// documentation.
pub fn staged_search(points: &[Point], mut time: impl FnMut(usize) -> Option<f64>) -> Option<usize> {
    let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
    for (i, p) in points.iter().enumerate() {
        match groups.iter_mut().find(|(g, _)| *g == p.group) {
            Some((_, members)) => members.push(i),
            None => groups.push((&p.group, vec![i])),
        }
    }
    let mut times: BTreeMap<usize, Option<f64>> = BTreeMap::new();
    let mut measure = |i: usize, times: &mut BTreeMap<usize, Option<f64>>| -> Option<f64> {
        *times.entry(i).or_insert_with(|| time(i))
    };
    for (_, members) in &groups {
        if members.len() <= FULL_SEARCH_LIMIT {
            for &i in members {
                measure(i, &mut times);
            }
            continue;
        }
        let dims = points[members[0]].coords.len();
        let mut current = points[members[0]].coords.clone();
        for _sweep in 0..2 {
            let mut moved = false;
            for d in 0..dims {
                // The candidates that differ from the current one in choice `d` alone.
                let line: Vec<usize> = members
                    .iter()
                    .copied()
                    .filter(|&i| (0..dims).all(|e| e == d || points[i].coords[e] == current[e]))
                    .collect();
                let mut best: Option<(f64, usize)> = None;
                for i in line {
                    if let Some(t) = measure(i, &mut times) {
                        if best.is_none_or(|(b, _)| t < b) {
                            best = Some((t, i));
                        }
                    }
                }
                if let Some((_, i)) = best {
                    if points[i].coords[d] != current[d] {
                        current[d] = points[i].coords[d].clone();
                        moved = true;
                    }
                }
            }
            if !moved {
                break;
            }
        }
    }
    times
        .iter()
        .filter_map(|(i, t)| t.map(|t| (t, *i)))
        .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
        .map(|(_, i)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid(group: &str, sizes: &[usize]) -> Vec<Point> {
        let total: usize = sizes.iter().product();
        (0..total)
            .map(|mut i| {
                let coords = sizes
                    .iter()
                    .map(|s| {
                        let c = i % s;
                        i /= s;
                        c.to_string()
                    })
                    .collect();
                Point { group: group.into(), coords }
            })
            .collect()
    }

    fn coord(p: &Point, d: usize) -> f64 {
        p.coords[d].parse().unwrap()
    }

    #[test]
    fn a_small_plan_is_timed_whole() {
        let points = grid("packed", &[30]);
        let mut timed = Vec::new();
        let best = staged_search(&points, |i| {
            timed.push(i);
            Some((i as f64 - 17.0).abs())
        });
        assert_eq!(best, Some(17));
        assert_eq!(timed.len(), 30);
        assert_eq!(search_bound(&points), 30);
    }

    #[test]
    fn a_large_plan_times_about_the_sum_of_its_choices_and_finds_a_separable_optimum() {
        // 3 × 30 × 5 = 450 candidates (a decode tiling, a prefill tiling, a split count).
        let points = grid("classed_split", &[3, 30, 5]);
        let cost = |p: &Point| {
            (coord(p, 0) - 2.0).abs() * 3.0 + (coord(p, 1) - 21.0).powi(2) + (coord(p, 2) - 1.0).abs() * 0.5
        };
        let mut timed = std::collections::HashSet::new();
        let best = staged_search(&points, |i| {
            assert!(timed.insert(i), "candidate {i} timed twice");
            Some(cost(&points[i]))
        });
        let b = &points[best.unwrap()];
        assert_eq!(b.coords, ["2", "21", "1"]);
        assert!(timed.len() <= search_bound(&points), "{} timed", timed.len());
        assert_eq!(search_bound(&points), 2 * (3 + 30 + 5));
    }

    #[test]
    fn failures_are_skipped_and_groups_are_searched_apart() {
        let mut points = grid("a", &[10, 10]);
        points.extend(grid("b", &[4]));
        // Every candidate of group a whose first choice is 0 fails (the search's start);
        // b's candidate 2 is the fastest of all.
        let best = staged_search(&points, |i| {
            let p = &points[i];
            match p.group.as_str() {
                "a" if p.coords[0] == "0" => None,
                "a" => Some(10.0 + coord(p, 0) + coord(p, 1)),
                _ => Some(if p.coords[0] == "2" { 1.0 } else { 50.0 }),
            }
        });
        assert_eq!(best, Some(102));
    }

    #[test]
    fn nothing_that_runs_gives_none() {
        assert_eq!(staged_search(&grid("a", &[100]), |_| None), None);
        assert_eq!(staged_search(&[], |_| Some(1.0)), None);
    }
}
