#include "examples/trainer/svg_chart.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "examples/trainer/format.h"

namespace ddp::examples::trainer {
namespace {

constexpr int kLeft = 78;     // room for y tick labels and the axis title
constexpr int kRight = 24;
constexpr int kTop = 70;      // title, subtitle
constexpr int kGap = 46;      // between panels (legend of the next one)
constexpr int kBottom = 56;   // x tick labels and axis title

std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out.push_back(c);
    }
  }
  return out;
}

// Decimals that print every multiple of `step` as itself: 0 for 5 or 20, 1
// for 0.5 or 2.5, 3 for 0.025 (at most 6).
int DecimalsOf(double step) {
  int decimals = 0;
  for (double s = std::fabs(step); decimals < 6 && std::fabs(s - std::round(s)) > 1e-9 * std::max(1.0, s);
       s *= 10) {
    ++decimals;
  }
  return decimals;
}

// The label of tick `v` among ticks `step` apart. The decimals follow the
// step: NiceTicks' steps of 2.5 (x 10^k) need one more than their
// magnitude, or ticks 2.5 apart read 0, 3, 5, 8, 10.
std::string TickLabel(double v, double step, bool percent, bool integer) {
  if (percent) return StringPrintf("%.*f%%", DecimalsOf(step * 100), v * 100);
  const int decimals = DecimalsOf(step);
  if (integer && decimals == 0) {
    if (std::fabs(v) >= 10000 && std::fmod(v, 1000) == 0) {
      return StringPrintf("%.0fk", v / 1000);
    }
    return FormatCount(std::llround(v));
  }
  return StringPrintf("%.*f", decimals, v);
}

struct Range {
  double lo = std::numeric_limits<double>::infinity();
  double hi = -std::numeric_limits<double>::infinity();
  void Add(double v) {
    if (!std::isfinite(v)) return;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  bool empty() const { return lo > hi; }
};

// Widens a degenerate or empty range so that ticks and scaling work.
void Pad(Range& r) {
  if (r.empty()) {
    r.lo = 0;
    r.hi = 1;
  } else if (r.hi - r.lo < 1e-12) {
    const double d = std::max(std::fabs(r.lo) * 0.1, 1e-3);
    r.lo -= d;
    r.hi += d;
  }
}

}  // namespace

std::vector<double> NiceTicks(double lo, double hi, int target, bool integer) {
  std::vector<double> ticks;
  if (!(hi > lo) || target < 1) return ticks;
  const double raw = (hi - lo) / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = 0;
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0}) {
    // An integer axis (steps, ranks) has no ticks between its values: 0.5
    // or 2.5 apart, half of them would be labelled with a value no point
    // can have.
    if (integer && m * mag != std::round(m * mag)) continue;
    step = m * mag;
    if (step >= raw) break;
  }
  if (integer) step = std::max(step, 1.0);
  const double first = std::ceil(lo / step - 1e-9) * step;
  for (double v = first; v <= hi + step * 1e-9; v += step) {
    ticks.push_back(std::fabs(v) < step * 1e-9 ? 0.0 : v);
    if (ticks.size() > 100) break;
  }
  return ticks;
}

std::string RenderSvgChart(const Chart& chart) {
  const int n_panels = std::max<int>(1, static_cast<int>(chart.panels.size()));
  const int height = kTop + n_panels * chart.panel_height + (n_panels - 1) * kGap + kBottom;
  const int plot_w = chart.width - kLeft - kRight;

  Range xr;
  for (const ChartPanel& p : chart.panels) {
    for (const ChartSeries& s : p.series) {
      for (const auto& [x, y] : s.points) xr.Add(x);
    }
  }
  for (const ChartMark& m : chart.marks) xr.Add(m.x);
  // Steps and rank counts read best from 0; a little room on the right keeps
  // the last point's marker inside the plot.
  if (!xr.empty() && chart.x_integer && xr.lo > 0) xr.lo = 0;
  Pad(xr);
  xr.hi += (xr.hi - xr.lo) * 0.02;
  auto sx = [&](double x) { return kLeft + (x - xr.lo) / (xr.hi - xr.lo) * plot_w; };

  std::string svg = StringPrintf(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
      "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">\n",
      chart.width, height, chart.width, height);
  svg += StringPrintf("<rect width=\"%d\" height=\"%d\" fill=\"#ffffff\"/>\n", chart.width, height);
  svg += StringPrintf("<text x=\"%d\" y=\"28\" font-size=\"18\" font-weight=\"bold\" fill=\"#222\">%s</text>\n",
                      kLeft, Escape(chart.title).c_str());
  if (!chart.subtitle.empty()) {
    svg += StringPrintf("<text x=\"%d\" y=\"48\" font-size=\"12\" fill=\"#666\">%s</text>\n", kLeft,
                        Escape(chart.subtitle).c_str());
  }
  const std::vector<double> xticks = NiceTicks(xr.lo, xr.hi, 8, chart.x_integer);
  const double xstep = xticks.size() > 1 ? xticks[1] - xticks[0] : 1;

  for (int pi = 0; pi < static_cast<int>(chart.panels.size()); ++pi) {
    const ChartPanel& panel = chart.panels[pi];
    const int top = kTop + pi * (chart.panel_height + kGap);
    const int bottom = top + chart.panel_height;
    Range yr;
    bool any = false;
    for (const ChartSeries& s : panel.series) {
      for (const auto& [x, y] : s.points) {
        yr.Add(y);
        any = true;
      }
    }
    const Range data = yr;
    if (panel.y_from_zero) yr.Add(0);
    Pad(yr);
    // A little air above and below the data.
    const double air = (yr.hi - yr.lo) * 0.06;
    if (!(panel.y_from_zero && yr.lo == 0)) yr.lo -= air;
    yr.hi += air;
    if (panel.percent) {
      // Fractions stay within 0% and 102% (room for a line at 100%) unless
      // the data lies outside: a scaling efficiency above 100% is drawn
      // inside the panel, not clipped away with its marker over the legend.
      if (data.empty() || data.lo >= 0) yr.lo = std::max(yr.lo, 0.0);
      if (data.empty() || data.hi <= 1) yr.hi = std::min(yr.hi, 1.02);
      if (yr.hi <= yr.lo) yr.hi = yr.lo + 0.01;
    }
    auto sy = [&](double y) { return bottom - (y - yr.lo) / (yr.hi - yr.lo) * chart.panel_height; };

    svg += StringPrintf("<g>\n<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"#fafafa\" stroke=\"#ccc\"/>\n",
                        kLeft, top, plot_w, chart.panel_height);
    // Grid and y ticks.
    const std::vector<double> yticks = NiceTicks(yr.lo, yr.hi, 5);
    const double ystep = yticks.size() > 1 ? yticks[1] - yticks[0] : 1;
    for (double v : yticks) {
      const double y = sy(v);
      svg += StringPrintf("<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#e4e4e4\"/>\n", kLeft, y,
                          kLeft + plot_w, y);
      svg += StringPrintf("<text x=\"%d\" y=\"%.1f\" font-size=\"11\" fill=\"#555\" text-anchor=\"end\">%s</text>\n",
                          kLeft - 6, y + 4, Escape(TickLabel(v, ystep, panel.percent, false)).c_str());
    }
    for (double v : xticks) {
      const double x = sx(v);
      svg += StringPrintf("<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"#eeeeee\"/>\n", x, top, x,
                          bottom);
      if (pi + 1 == static_cast<int>(chart.panels.size())) {
        svg += StringPrintf("<text x=\"%.1f\" y=\"%d\" font-size=\"11\" fill=\"#555\" text-anchor=\"middle\">%s</text>\n",
                            x, bottom + 16, Escape(TickLabel(v, xstep, false, chart.x_integer)).c_str());
      }
    }
    // Marks (epoch boundaries), labelled in the first panel.
    for (const ChartMark& m : chart.marks) {
      const double x = sx(m.x);
      svg += StringPrintf("<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"#999\" stroke-dasharray=\"2,3\"/>\n",
                          x, top, x, bottom);
      if (pi == 0 && !m.label.empty()) {
        svg += StringPrintf("<text x=\"%.1f\" y=\"%d\" font-size=\"10\" fill=\"#777\" text-anchor=\"end\">%s</text>\n",
                            x - 3, top + 12, Escape(m.label).c_str());
      }
    }
    // Axis title, rotated.
    const int mid = (top + bottom) / 2;
    svg += StringPrintf("<text x=\"18\" y=\"%d\" font-size=\"12\" fill=\"#333\" text-anchor=\"middle\" "
                        "transform=\"rotate(-90 18 %d)\">%s</text>\n",
                        mid, mid, Escape(panel.y_label).c_str());
    // Series, clipped to the plot.
    svg += StringPrintf("<clipPath id=\"clip%d\"><rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\"/></clipPath>\n",
                        pi, kLeft, top, plot_w, chart.panel_height);
    for (const ChartSeries& s : panel.series) {
      if (s.points.empty()) continue;
      std::string path;
      for (size_t i = 0; i < s.points.size(); ++i) {
        const auto& [x, y] = s.points[i];
        if (!std::isfinite(y)) continue;
        path += StringPrintf("%s%.1f,%.1f ", path.empty() ? "M" : "L", sx(x), sy(y));
      }
      if (path.empty()) continue;
      svg += StringPrintf("<path clip-path=\"url(#clip%d)\" d=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"2.2\" "
                          "stroke-linejoin=\"round\"%s/>\n",
                          pi, path.c_str(), s.color.c_str(), s.dashed ? " stroke-dasharray=\"7,4\"" : "");
      if (s.markers) {
        for (const auto& [x, y] : s.points) {
          if (!std::isfinite(y)) continue;
          svg += StringPrintf("<circle cx=\"%.1f\" cy=\"%.1f\" r=\"4\" fill=\"%s\" stroke=\"#fff\" stroke-width=\"1\"/>\n",
                              sx(x), sy(y), s.color.c_str());
        }
      }
    }
    if (!any) {
      svg += StringPrintf("<text x=\"%d\" y=\"%d\" font-size=\"13\" fill=\"#999\" text-anchor=\"middle\">no data yet</text>\n",
                          kLeft + plot_w / 2, mid);
    }
    // Legend above the panel, right-aligned.
    int lx = kLeft + plot_w;
    for (auto it = panel.series.rbegin(); it != panel.series.rend(); ++it) {
      const int text_w = static_cast<int>(it->name.size()) * 7 + 8;
      lx -= text_w + 34;
      const int ly = top - 10;
      svg += StringPrintf("<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"%s\" stroke-width=\"3\"%s/>\n", lx,
                          ly - 4, lx + 20, ly - 4, it->color.c_str(),
                          it->dashed ? " stroke-dasharray=\"6,3\"" : "");
      svg += StringPrintf("<text x=\"%d\" y=\"%d\" font-size=\"12\" fill=\"#333\">%s</text>\n", lx + 25, ly,
                          Escape(it->name).c_str());
    }
    svg += "</g>\n";
  }
  svg += StringPrintf("<text x=\"%d\" y=\"%d\" font-size=\"12\" fill=\"#333\" text-anchor=\"middle\">%s</text>\n",
                      kLeft + plot_w / 2, height - 14, Escape(chart.x_label).c_str());
  svg += "</svg>\n";
  return svg;
}

}  // namespace ddp::examples::trainer
