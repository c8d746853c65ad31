package serve

import (
	"fmt"
	"image"
	"image/color"
	"image/png"
	"math"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/latentmesh/latentmesh/agent/jobs"
)

// WritePlot draws the latency CDF of each class above a Gantt chart of
// about sample jobs spread over the run, as a PNG (standard library only:
// a 3x5 pixel font draws the labels).
func (rep *Report) WritePlot(path string, sample int) error {
	const W, H = 1000, 820
	img := image.NewRGBA(image.Rect(0, 0, W, H))
	fillRect(img, 0, 0, W, H, color.RGBA{255, 255, 255, 255})
	title := fmt.Sprintf("%s, %d GPUs", rep.Topology, rep.GPUs)
	if rep.Pools != "" {
		title += " (E:D:V " + rep.Pools + ")"
	}
	title += fmt.Sprintf(", time x%g, simulated seconds", rep.Compression)
	drawText(img, 20, 8, title, black, 2)
	rep.plotCDF(img, image.Rect(70, 40, W-20, 360))
	rep.plotGantt(img, image.Rect(180, 420, W-20, H-40), sample)
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := png.Encode(f, img); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

var (
	black   = color.RGBA{0, 0, 0, 255}
	grey    = color.RGBA{200, 200, 200, 255}
	palette = []color.RGBA{{31, 119, 180, 255}, {255, 127, 14, 255}, {44, 160, 44, 255}, {214, 39, 40, 255}, {148, 103, 189, 255}, {140, 86, 75, 255}}
	stageC  = map[jobs.Stage]color.RGBA{jobs.Encode: {31, 119, 180, 255}, jobs.Denoise: {255, 127, 14, 255}, jobs.Decode: {44, 160, 44, 255}}
)

func (rep *Report) plotCDF(img *image.RGBA, r image.Rectangle) {
	lat := map[string][]float64{}
	xmax := 1.0
	for _, j := range rep.Jobs {
		if j.Error == "" {
			lat[j.Class] = append(lat[j.Class], j.Latency)
			xmax = math.Max(xmax, j.Latency)
		}
	}
	for _, c := range rep.Classes {
		xmax = math.Max(xmax, c.SLO)
	}
	xmax = niceCeil(xmax * 1.05)
	axes(img, r, xmax, "LATENCY S", "CDF")
	for i, c := range rep.Classes {
		col := palette[i%len(palette)]
		xs := append([]float64(nil), lat[c.Name]...)
		sort.Float64s(xs)
		px, py := r.Min.X, r.Max.Y
		for k, x := range xs {
			nx := r.Min.X + int(x/xmax*float64(r.Dx()))
			ny := r.Max.Y - int(float64(k+1)/float64(len(xs))*float64(r.Dy()))
			line(img, px, py, nx, py, col)
			line(img, nx, py, nx, ny, col)
			px, py = nx, ny
		}
		// The SLO as a dashed vertical line in the class's colour.
		sx := r.Min.X + int(c.SLO/xmax*float64(r.Dx()))
		for y := r.Min.Y; y < r.Max.Y; y += 6 {
			line(img, sx, y, sx, min(y+3, r.Max.Y), col)
		}
		label := fmt.Sprintf("%s P50 %.1f P99 %.1f SLO %.0f", c.Name, c.Latency.P50, c.Latency.P99, c.SLO)
		fillRect(img, r.Max.X-470, r.Max.Y-20-14*(len(rep.Classes)-i), 12, 8, col)
		drawText(img, r.Max.X-452, r.Max.Y-20-14*(len(rep.Classes)-i), label, black, 2)
	}
}

func (rep *Report) plotGantt(img *image.RGBA, r image.Rectangle, sample int) {
	var pick []JobRecord
	var done []JobRecord
	for _, j := range rep.Jobs {
		if j.Error == "" {
			done = append(done, j)
		}
	}
	step := max(1, len(done)/max(1, sample))
	for k := 0; k < len(done) && len(pick) < sample; k += step {
		pick = append(pick, done[k])
	}
	if len(pick) == 0 {
		return
	}
	spans := map[spanJob][]int{}
	for i, s := range rep.spans {
		spans[jobOfSpan(s)] = append(spans[jobOfSpan(s)], i)
	}
	t0, t1 := pick[0].t0, pick[0].t1
	for _, j := range pick {
		if j.t0.Before(t0) {
			t0 = j.t0
		}
		if j.t1.After(t1) {
			t1 = j.t1
		}
	}
	sim := func(t time.Time) float64 { return t.Sub(t0).Seconds() * rep.Compression }
	xmax := niceCeil(sim(t1))
	axes(img, r, xmax, "TIME S", "")
	x := func(t time.Time) int { return r.Min.X + int(sim(t)/xmax*float64(r.Dx())) }
	rowH := r.Dy() / len(pick)
	for i, j := range pick {
		y := r.Min.Y + i*rowH + 2
		h := max(2, rowH-4)
		fillRect(img, x(j.t0), y+h/3, max(1, x(j.t1)-x(j.t0)), max(1, h/3), grey)
		for _, k := range spans[j.job] {
			s := rep.spans[k]
			fillRect(img, x(s.Start), y, max(1, x(s.End)-x(s.Start)), h, stageC[s.Stage])
		}
		name := j.Class
		if k := strings.Index(name, "/"); k > 0 {
			name = shortModel(name[:k]) + name[k:]
		}
		drawText(img, 4, y+h/2-5, name, black, 2)
	}
	lx := r.Min.X
	for _, st := range jobs.Stages() {
		fillRect(img, lx, r.Min.Y-22, 12, 8, stageC[st])
		drawText(img, lx+16, r.Min.Y-22, strings.ToUpper(string(st))+" ON GPU", black, 2)
		lx += 170
	}
	fillRect(img, lx, r.Min.Y-20, 12, 4, grey)
	drawText(img, lx+16, r.Min.Y-22, "SUBMITTED TO DONE", black, 2)
}

func shortModel(m string) string {
	switch {
	case strings.HasPrefix(m, "wan2.1-t2v-"):
		return "WAN" + strings.ToUpper(strings.TrimPrefix(m, "wan2.1-t2v-"))
	case strings.HasPrefix(m, "flux"):
		return "FLUX"
	case strings.HasPrefix(m, "qwen"):
		return "QWEN"
	}
	return m
}

// axes draws the frame, x ticks and labels of a panel.
func axes(img *image.RGBA, r image.Rectangle, xmax float64, xlabel, ylabel string) {
	line(img, r.Min.X, r.Max.Y, r.Max.X, r.Max.Y, black)
	line(img, r.Min.X, r.Min.Y, r.Min.X, r.Max.Y, black)
	tick := niceCeil(xmax / 8)
	for v := 0.0; v <= xmax+1e-9; v += tick {
		px := r.Min.X + int(v/xmax*float64(r.Dx()))
		line(img, px, r.Max.Y, px, r.Max.Y+4, black)
		drawText(img, px-6, r.Max.Y+8, fmt.Sprintf("%g", v), black, 2)
	}
	drawText(img, r.Max.X-len(xlabel)*8, r.Max.Y+22, xlabel, black, 2)
	if ylabel != "" {
		for _, v := range []float64{0, 0.5, 1} {
			py := r.Max.Y - int(v*float64(r.Dy()))
			line(img, r.Min.X-4, py, r.Min.X, py, black)
			drawText(img, r.Min.X-30, py-5, fmt.Sprintf("%g", v), black, 2)
		}
		drawText(img, 4, r.Min.Y, ylabel, black, 2)
	}
}

// niceCeil rounds x up to 1, 2 or 5 times a power of ten.
func niceCeil(x float64) float64 {
	if x <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(x)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= x {
			return m * p
		}
	}
	return 10 * p
}

func fillRect(img *image.RGBA, x, y, w, h int, c color.RGBA) {
	for j := y; j < y+h; j++ {
		for i := x; i < x+w; i++ {
			img.SetRGBA(i, j, c)
		}
	}
}

func line(img *image.RGBA, x0, y0, x1, y1 int, c color.RGBA) {
	dx, dy := abs(x1-x0), -abs(y1-y0)
	sx, sy := sign(x1-x0), sign(y1-y0)
	e := dx + dy
	for {
		img.SetRGBA(x0, y0, c)
		if x0 == x1 && y0 == y1 {
			return
		}
		if e2 := 2 * e; e2 >= dy {
			e += dy
			x0 += sx
		} else {
			e += dx
			y0 += sy
		}
	}
}

func abs(x int) int { return max(x, -x) }
func sign(x int) int {
	switch {
	case x > 0:
		return 1
	case x < 0:
		return -1
	}
	return 0
}

// drawText draws s in a 3x5 font scaled by k; lower case is drawn upper.
func drawText(img *image.RGBA, x, y int, s string, c color.RGBA, k int) {
	for _, ch := range strings.ToUpper(s) {
		g, ok := glyphs[ch]
		if !ok {
			g = glyphs['?']
		}
		for row := range 5 {
			for col := range 3 {
				if g[row][col] == '#' {
					fillRect(img, x+col*k, y+row*k, k, k, c)
				}
			}
		}
		x += 4 * k
	}
}

var glyphs = map[rune][5]string{
	' ': {"   ", "   ", "   ", "   ", "   "}, '?': {"## ", "  #", " # ", "   ", " # "},
	'0': {"###", "# #", "# #", "# #", "###"}, '1': {" # ", "## ", " # ", " # ", "###"},
	'2': {"###", "  #", "###", "#  ", "###"}, '3': {"###", "  #", " ##", "  #", "###"},
	'4': {"# #", "# #", "###", "  #", "  #"}, '5': {"###", "#  ", "###", "  #", "###"},
	'6': {"###", "#  ", "###", "# #", "###"}, '7': {"###", "  #", " # ", " # ", " # "},
	'8': {"###", "# #", "###", "# #", "###"}, '9': {"###", "# #", "###", "  #", "###"},
	'A': {" # ", "# #", "###", "# #", "# #"}, 'B': {"## ", "# #", "## ", "# #", "## "},
	'C': {" ##", "#  ", "#  ", "#  ", " ##"}, 'D': {"## ", "# #", "# #", "# #", "## "},
	'E': {"###", "#  ", "## ", "#  ", "###"}, 'F': {"###", "#  ", "## ", "#  ", "#  "},
	'G': {" ##", "#  ", "# #", "# #", " ##"}, 'H': {"# #", "# #", "###", "# #", "# #"},
	'I': {"###", " # ", " # ", " # ", "###"}, 'J': {"  #", "  #", "  #", "# #", " # "},
	'K': {"# #", "# #", "## ", "# #", "# #"}, 'L': {"#  ", "#  ", "#  ", "#  ", "###"},
	'M': {"# #", "###", "###", "# #", "# #"}, 'N': {"## ", "# #", "# #", "# #", "# #"},
	'O': {" # ", "# #", "# #", "# #", " # "}, 'P': {"## ", "# #", "## ", "#  ", "#  "},
	'Q': {" # ", "# #", "# #", "###", " ##"}, 'R': {"## ", "# #", "## ", "# #", "# #"},
	'S': {" ##", "#  ", " # ", "  #", "## "}, 'T': {"###", " # ", " # ", " # ", " # "},
	'U': {"# #", "# #", "# #", "# #", "###"}, 'V': {"# #", "# #", "# #", "# #", " # "},
	'W': {"# #", "# #", "###", "###", "# #"}, 'X': {"# #", "# #", " # ", "# #", "# #"},
	'Y': {"# #", "# #", " # ", " # ", " # "}, 'Z': {"###", "  #", " # ", "#  ", "###"},
	'.': {"   ", "   ", "   ", "   ", " # "}, ',': {"   ", "   ", "   ", " # ", "#  "},
	':': {"   ", " # ", "   ", " # ", "   "}, '-': {"   ", "   ", "###", "   ", "   "},
	'/': {"  #", "  #", " # ", "#  ", "#  "}, '(': {" # ", "#  ", "#  ", "#  ", " # "},
	')': {" # ", "  #", "  #", "  #", " # "}, '%': {"# #", "  #", " # ", "#  ", "# #"},
	'+': {"   ", " # ", "###", " # ", "   "}, '_': {"   ", "   ", "   ", "   ", "###"},
	'=': {"   ", "###", "   ", "###", "   "},
}
