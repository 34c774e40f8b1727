#include "examples/trainer/svg_chart.h"

#include "gtest/gtest.h"

namespace ddp::examples::trainer {
namespace {

TEST(NiceTicksTest, RoundStepsCoverTheRange) {
  EXPECT_EQ(NiceTicks(0, 100, 5), (std::vector<double>{0, 20, 40, 60, 80, 100}));
  const std::vector<double> acc = NiceTicks(0.61, 0.89, 5);
  ASSERT_EQ(acc.size(), 2u);
  EXPECT_NEAR(acc[0], 0.7, 1e-12);
  EXPECT_NEAR(acc[1], 0.8, 1e-12);
  EXPECT_EQ(NiceTicks(0.5, 1.0, 5).size(), 6u);  // 0.5, 0.6, ..., 1.0
  EXPECT_EQ(NiceTicks(0, 938, 8), (std::vector<double>{0, 200, 400, 600, 800}));
  EXPECT_TRUE(NiceTicks(1, 1, 5).empty());
}

Chart Example() {
  Chart c;
  c.title = "cnn on fashion_mnist <2 ranks>";
  c.x_label = "step";
  ChartPanel loss;
  loss.y_label = "loss";
  loss.series.push_back({"train loss", kTrainLossColor, {{10, 2.3}, {20, 1.1}, {30, 0.7}}, false, false});
  ChartPanel acc;
  acc.y_label = "accuracy";
  acc.percent = true;
  acc.series.push_back({"test accuracy", kAccuracyColor, {{30, 0.81}}, true, false});
  c.panels = {loss, acc};
  c.marks = {{30, "epoch 1"}};
  return c;
}

TEST(SvgChartTest, IsAStandaloneDocumentWithEverySeries) {
  const std::string svg = RenderSvgChart(Example());
  EXPECT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_NE(svg.find("stroke=\"#1f77b4\""), std::string::npos);
  EXPECT_NE(svg.find("fill=\"#2ca02c\""), std::string::npos);
  EXPECT_NE(svg.find("&lt;2 ranks&gt;"), std::string::npos) << "text is escaped";
  EXPECT_NE(svg.find(">epoch 1<"), std::string::npos);
  EXPECT_NE(svg.find(">80%<"), std::string::npos) << "percent ticks";
  EXPECT_EQ(svg.find("<script"), std::string::npos);
  EXPECT_EQ(svg.find("href"), std::string::npos) << "no external resources";
}

TEST(SvgChartTest, EmptyPanelsSayNoData) {
  Chart c;
  c.panels.resize(1);
  c.panels[0].series.push_back({"loss", kTrainLossColor, {}, false, false});
  const std::string svg = RenderSvgChart(c);
  EXPECT_NE(svg.find("no data yet"), std::string::npos);
  EXPECT_EQ(svg.find("nan"), std::string::npos);
  EXPECT_EQ(svg.find("inf"), std::string::npos);
}

}  // namespace
}  // namespace ddp::examples::trainer
