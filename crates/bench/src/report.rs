//! `--report DIR`: a self-contained HTML page (SVG charts inline, drawn with plotters) beside
//! the benchmark's JSON, so a run can be looked at rather than read.

use std::path::Path;

use anyhow::Context;
use plotters::prelude::*;

const SIZE: (u32, u32) = (760, 420);
const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// A chart's failure as an error of the benchmark (plotters' own error is generic over its
/// backend).
fn chart_err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("drawing a chart: {e}")
}

/// Every chart's legend, in its lower right corner.
fn legend<'a, DB, CT>(chart: &mut ChartContext<'a, DB, CT>) -> anyhow::Result<()>
where
    DB: DrawingBackend + 'a,
    CT: CoordTranslate,
{
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.9))
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(chart_err)
}

/// Empirical CDFs: one line per series of samples (ms), x on a log scale.
pub fn cdf(title: &str, series: &[(String, Vec<f64>)]) -> anyhow::Result<String> {
    let all = series.iter().flat_map(|(_, v)| v.iter().copied());
    let (lo, hi) = all.fold((f64::INFINITY, 0.0f64), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    });
    let (lo, hi) = if lo.is_finite() && hi > 0.0 {
        ((lo * 0.8).max(0.01), hi * 1.25)
    } else {
        (1.0, 10.0)
    };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(chart_err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d((lo..hi).log_scale(), 0.0..1.0)
            .map_err(chart_err)?;
        chart
            .configure_mesh()
            .x_desc("TTFT (ms)")
            .y_desc("share of requests")
            .draw()
            .map_err(chart_err)?;
        for (i, (name, v)) in series.iter().enumerate() {
            let mut v = v.clone();
            v.sort_by(|a, b| a.total_cmp(b));
            let n = v.len() as f64;
            let color = COLORS[i % COLORS.len()];
            let points = v
                .iter()
                .enumerate()
                .flat_map(|(k, &x)| [(x, k as f64 / n), (x, (k + 1) as f64 / n)]);
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(2)))
                .map_err(chart_err)?
                .label(name.as_str())
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color));
        }
        legend(&mut chart)?;
        root.present().map_err(chart_err)?;
    }
    Ok(svg)
}

/// Lines through points (x, y), one per series; x on a log scale (sizes), y log or linear.
pub fn lines(
    title: &str,
    (x_desc, y_desc): (&str, &str),
    log_y: bool,
    series: &[(String, Vec<(f64, f64)>)],
) -> anyhow::Result<String> {
    let points = || series.iter().flat_map(|(_, v)| v.iter().copied());
    let range = |vals: &mut dyn Iterator<Item = f64>| {
        let (lo, hi) = vals
            .filter(|v| v.is_finite() && *v > 0.0)
            .fold((f64::INFINITY, 0.0f64), |(lo, hi), x| {
                (lo.min(x), hi.max(x))
            });
        if lo.is_finite() {
            (lo * 0.8, hi * 1.25)
        } else {
            (1.0, 10.0)
        }
    };
    let (x_lo, x_hi) = range(&mut points().map(|p| p.0));
    let (y_lo, y_hi) = range(&mut points().map(|p| p.1));
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(chart_err)?;
        let mut builder = ChartBuilder::on(&root);
        builder
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60);
        // The two y scales are two chart types; everything after is the same.
        macro_rules! draw {
            ($chart:expr) => {{
                let mut chart = $chart.map_err(chart_err)?;
                chart
                    .configure_mesh()
                    .x_desc(x_desc)
                    .y_desc(y_desc)
                    .draw()
                    .map_err(chart_err)?;
                for (i, (name, v)) in series.iter().enumerate() {
                    let color = COLORS[i % COLORS.len()];
                    let mut v = v.clone();
                    v.sort_by(|a, b| a.0.total_cmp(&b.0));
                    chart
                        .draw_series(LineSeries::new(v.iter().copied(), color.stroke_width(2)))
                        .map_err(chart_err)?
                        .label(name.as_str())
                        .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color));
                    chart
                        .draw_series(v.iter().map(|&p| Circle::new(p, 3, color.filled())))
                        .map_err(chart_err)?;
                }
                legend(&mut chart)?;
            }};
        }
        if log_y {
            draw!(builder.build_cartesian_2d((x_lo..x_hi).log_scale(), (y_lo..y_hi).log_scale()));
        } else {
            draw!(builder.build_cartesian_2d((x_lo..x_hi).log_scale(), 0.0..y_hi));
        }
        root.present().map_err(chart_err)?;
    }
    Ok(svg)
}

/// Stacked horizontal bars: one bar per category, one layer per named part (ms).
pub fn stacked(
    title: &str,
    categories: &[String],
    parts: &[(String, Vec<f64>)],
) -> anyhow::Result<String> {
    let total = |c: usize| {
        parts
            .iter()
            .map(|(_, v)| v.get(c).copied().unwrap_or(0.0))
            .sum::<f64>()
    };
    let hi = (0..categories.len()).map(total).fold(1.0f64, f64::max) * 1.1;
    let n = categories.len().max(1);
    let mut svg = String::new();
    {
        let h = 120 + 34 * n as u32;
        let root = SVGBackend::with_string(&mut svg, (SIZE.0, h)).into_drawing_area();
        root.fill(&WHITE).map_err(chart_err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(170)
            .build_cartesian_2d(0.0..hi, (0..n).into_segmented())
            .map_err(chart_err)?;
        let names = categories.to_vec();
        chart
            .configure_mesh()
            .disable_y_mesh()
            .x_desc("mean time (ms)")
            .y_label_formatter(&|s: &SegmentValue<usize>| match s {
                SegmentValue::CenterOf(i) => names.get(*i).cloned().unwrap_or_default(),
                _ => String::new(),
            })
            .y_labels(n)
            .draw()
            .map_err(chart_err)?;
        let mut start = vec![0.0; n];
        for (i, (name, v)) in parts.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let bars: Vec<Rectangle<(f64, SegmentValue<usize>)>> = (0..n)
                .map(|c| {
                    let w = v.get(c).copied().unwrap_or(0.0).max(0.0);
                    let r = Rectangle::new(
                        [
                            (start[c], SegmentValue::Exact(c)),
                            (start[c] + w, SegmentValue::Exact(c + 1)),
                        ],
                        color.filled(),
                    );
                    start[c] += w;
                    r
                })
                .collect();
            chart
                .draw_series(bars)
                .map_err(chart_err)?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled())
                });
        }
        legend(&mut chart)?;
        root.present().map_err(chart_err)?;
    }
    Ok(svg)
}

/// Writes `DIR/<name>.html` (the charts inline, then `notes` as preformatted text),
/// `DIR/<name>.json`, and each chart as `DIR/<name>-<n>.svg` (n from 1: what the book embeds).
pub fn write(
    dir: &Path,
    name: &str,
    title: &str,
    charts: &[String],
    notes: &str,
    json: &str,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let esc = |s: &str| {
        s.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
    };
    let mut html = format!(
        "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{t}</title>\
         <style>body{{font-family:sans-serif;max-width:800px;margin:2em auto}}\
         pre{{background:#f6f6f6;padding:1em;overflow:auto}}</style></head><body>\n<h1>{t}</h1>\n",
        t = esc(title)
    );
    for (i, c) in charts.iter().enumerate() {
        let file = dir.join(format!("{name}-{}.svg", i + 1));
        std::fs::write(&file, c).with_context(|| format!("writing {}", file.display()))?;
        html.push_str("<figure>");
        // The SVG's own XML declaration does not belong inside HTML.
        let svg = match c.trim_start().strip_prefix("<?xml") {
            Some(rest) => rest.split_once("?>").map_or(rest, |(_, svg)| svg),
            None => c,
        };
        html.push_str(svg);
        html.push_str("</figure>\n");
    }
    html.push_str(&format!("<pre>{}</pre>\n</body></html>\n", esc(notes)));
    let page = dir.join(format!("{name}.html"));
    std::fs::write(&page, html).with_context(|| format!("writing {}", page.display()))?;
    let data = dir.join(format!("{name}.json"));
    std::fs::write(&data, json).with_context(|| format!("writing {}", data.display()))?;
    println!("report: {} and {}", page.display(), data.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_draw_every_series_and_the_page_holds_them() {
        let a = cdf(
            "TTFT",
            &[
                ("pull".into(), vec![10.0, 20.0, 30.0]),
                ("push".into(), vec![5.0, 6.0]),
            ],
        )
        .unwrap();
        assert!(a.starts_with("<svg") || a.contains("<svg"), "{a}");
        assert!(a.contains("pull") && a.contains("push"));
        let b = stacked(
            "phases",
            &["pull 2048".into(), "push 2048".into()],
            &[
                ("prefill".into(), vec![200.0, 250.0]),
                ("transfer".into(), vec![50.0, 0.0]),
            ],
        )
        .unwrap();
        assert!(b.contains("pull 2048") && b.contains("transfer"));
        let l = lines(
            "cost",
            ("handoffs", "ns"),
            true,
            &[
                ("grant".into(), vec![(1e3, 50.0), (1e5, 80.0)]),
                ("tick".into(), vec![(1e3, 5.0), (1e5, 6.0)]),
            ],
        )
        .unwrap();
        assert!(l.contains("grant") && l.contains("tick"));
        // One marker per point.
        assert_eq!(l.matches("<circle").count(), 4, "{l}");
        let dir = std::env::temp_dir().join(format!("handoff-report-{}", std::process::id()));
        write(&dir, "x", "a <test>", &[a, b], "notes & more", "{}").unwrap();
        let page = std::fs::read_to_string(dir.join("x.html")).unwrap();
        assert_eq!(page.matches("<svg").count(), 2, "{page}");
        assert!(!page.contains("<?xml"));
        assert!(page.contains("a &lt;test&gt;") && page.contains("notes &amp; more"));
        assert_eq!(std::fs::read_to_string(dir.join("x.json")).unwrap(), "{}");
        for n in [1, 2] {
            let svg = std::fs::read_to_string(dir.join(format!("x-{n}.svg"))).unwrap();
            assert!(svg.contains("<svg"), "chart {n} on its own");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
