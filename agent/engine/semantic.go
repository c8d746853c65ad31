package engine

import "math"

// What words mean to the built-in model. A real text encoder learns that
// "red" and "snow" and "neon" are colours and places; this one is told, by a
// small lexicon. Each known word's embedding row carries, besides its seeded
// random part, a code in the last semWidth dimensions of the embedding: a
// presence count, weighted colours for the object, the sky and the ground,
// a weighted shape, how varied the object's hues are, and two traits
// (bands, flatness). Unknown
// words carry only presence, so they dilute the known ones and leave the
// seeded look alone.
//
// The code survives encoding and pooling because both are linear in it up to
// layerNorm's shift and scale: dimension semRef is zero in every code, so
// reading each dimension relative to it undoes the shift, and reading
// weighted values as ratios (colour over its weight, weight over presence)
// undoes the scale. The denoiser reads it off the pooled conditioning only,
// never off the prompt text.

// The code's layout, relative to the first semantic dimension.
const (
	semRef      = iota // always zero: the level the others are read against
	semPresence        // 1 a word (a little for stop words)
	semObjW            // object colour: weight, then weight x (luma, red-green, yellow-blue)
	semObjL
	semObjA
	semObjB
	semSkyW // sky (the background above the horizon)
	semSkyL
	semSkyA
	semSkyB
	semGroundW // ground (the background below it)
	semGroundL
	semGroundA
	semGroundB
	semShapeW // shape: weight, then weight x (count, radius, aspect, squareness, height)
	semShapeCount
	semShapeRadius
	semShapeAspect
	semShapeSquare
	semShapeLow
	semBands   // horizontal bands (water), per presence
	semVariety // object weight x how far blob hues spread around its colour
	semFlat    // washed out, low contrast (negative prompts' words), per presence
	semWidth
)

// semScale sizes the code against the unit-variance random part of a row.
const semScale = 0.4

// semantic reports whether cfg's embedding has room for the code next to a
// random part wide enough to tell prompts apart, and its vocabulary room for
// the known words' ids with plenty left for hashing the others.
func semantic(cfg Config) bool {
	return cfg.EmbedDim >= 2*semWidth && cfg.VocabSize >= 8*lexiconWords
}

// lexiconWords bounds the number of words in the lexicon.
const lexiconWords = 256

// tint is a weighted colour given as the sRGB bytes it should decode to.
type tint struct {
	w   float64
	rgb [3]uint8
}

// form is a weighted shape: how many blobs, their radius (in units of the
// longer side), height over width, squareness in [0, 1] and the height of
// their centres (0 top, 1 bottom).
type form struct {
	w, count, radius, aspect, square, low float64
}

// meaning is what one word adds to a picture.
type meaning struct {
	obj, sky, ground     tint
	shape                form
	bands, variety, flat float64
	stop                 bool // a stop word: counts little towards presence
}

// lexEntry gives words one meaning.
type lexEntry struct {
	words []string
	m     meaning
}

// lexicon lists the words the built-in model knows (at most lexiconWords);
// the order gives their token ids, so it is part of the algorithm.
func lexicon() []lexEntry {
	// Shapes and meanings used by several words.
	round1 := form{w: 1, count: 1, radius: 0.24, aspect: 0.8, low: 0.58}
	fruits := form{w: 1, count: 4, radius: 0.1, aspect: 1, low: 0.62}
	buildings := form{w: 1.5, count: 5, radius: 0.13, aspect: 2.4, square: 1, low: 0.66}
	water := meaning{sky: tint{0.5, [3]uint8{130, 180, 235}}, ground: tint{1.5, [3]uint8{20, 70, 175}}, bands: 1}
	snow := meaning{sky: tint{1, [3]uint8{232, 238, 248}}, ground: tint{1.5, [3]uint8{252, 252, 254}}}
	forest := meaning{sky: tint{1, [3]uint8{50, 105, 55}}, ground: tint{1, [3]uint8{25, 80, 30}}}
	grass := meaning{sky: tint{0.5, [3]uint8{140, 190, 240}}, ground: tint{1, [3]uint8{60, 150, 50}}}
	sand := meaning{sky: tint{0.3, [3]uint8{130, 190, 240}}, ground: tint{1, [3]uint8{225, 200, 140}}}
	dusk := meaning{sky: tint{1.5, [3]uint8{250, 130, 40}}, ground: tint{1, [3]uint8{110, 40, 130}},
		obj: tint{0.4, [3]uint8{255, 210, 90}}, shape: form{w: 0.3, count: 1, radius: 0.13, aspect: 1, low: 0.42}}
	night := meaning{sky: tint{1.5, [3]uint8{10, 14, 40}}, ground: tint{1.5, [3]uint8{6, 6, 16}}}
	neon := meaning{obj: tint{1.5, [3]uint8{255, 40, 200}}, variety: 1, sky: tint{0.5, [3]uint8{25, 10, 55}}, ground: tint{0.5, [3]uint8{15, 8, 35}}}
	city := meaning{obj: tint{0.3, [3]uint8{95, 95, 110}}, shape: buildings, sky: tint{0.5, [3]uint8{110, 110, 125}}, ground: tint{0.5, [3]uint8{60, 60, 70}}}
	storm := meaning{sky: tint{1.5, [3]uint8{60, 65, 80}}, ground: tint{0.5, [3]uint8{40, 45, 55}}}
	fog := meaning{sky: tint{1, [3]uint8{200, 200, 206}}, ground: tint{0.7, [3]uint8{178, 180, 186}}}
	sky := meaning{sky: tint{0.3, [3]uint8{120, 175, 240}}}
	wood := meaning{ground: tint{1, [3]uint8{130, 80, 40}}, sky: tint{1, [3]uint8{215, 195, 160}}}
	space := meaning{sky: tint{1.5, [3]uint8{5, 5, 22}}, ground: tint{1.5, [3]uint8{12, 6, 32}}}
	fire := meaning{sky: tint{1, [3]uint8{200, 60, 10}}, ground: tint{1, [3]uint8{240, 120, 20}}, obj: tint{0.5, [3]uint8{255, 200, 50}}}
	rock := meaning{ground: tint{0.7, [3]uint8{100, 95, 90}}}
	deep := meaning{sky: tint{0.5, [3]uint8{10, 45, 95}}, ground: tint{0.5, [3]uint8{5, 20, 60}}}
	dull := meaning{flat: 1}
	stop := meaning{stop: true}
	paint := func(r, g, b uint8) meaning { return meaning{obj: tint{3, [3]uint8{r, g, b}}} }
	thing := func(r, g, b uint8, f form) meaning { return meaning{obj: tint{1, [3]uint8{r, g, b}}, shape: f} }
	return []lexEntry{
		{[]string{"a", "an", "the", "of", "in", "on", "at", "over", "under", "onto", "into", "with", "and", "by", "to", "from", "near", "is"}, stop},
		// Colours.
		{[]string{"red", "crimson", "scarlet"}, paint(205, 30, 30)},
		{[]string{"orange"}, paint(240, 120, 20)},
		{[]string{"yellow"}, paint(240, 210, 40)},
		{[]string{"green", "emerald"}, paint(40, 165, 55)},
		{[]string{"blue"}, paint(30, 70, 205)},
		{[]string{"purple", "violet"}, paint(130, 40, 175)},
		{[]string{"pink"}, paint(245, 110, 175)},
		{[]string{"white"}, paint(245, 245, 245)},
		{[]string{"black"}, paint(22, 22, 22)},
		{[]string{"brown"}, paint(120, 70, 30)},
		{[]string{"grey", "gray"}, paint(128, 128, 128)},
		{[]string{"golden", "gold"}, paint(225, 170, 40)},
		{[]string{"silver"}, paint(190, 190, 200)},
		{[]string{"cyan", "turquoise"}, paint(30, 205, 215)},
		{[]string{"magenta"}, paint(225, 30, 185)},
		{[]string{"teal"}, paint(20, 130, 130)},
		// Things.
		{[]string{"fox", "foxes"}, thing(215, 85, 20, round1)},
		{[]string{"cat", "kitten"}, thing(150, 120, 90, round1)},
		{[]string{"dog", "puppy", "horse", "bear"}, thing(125, 80, 40, round1)},
		{[]string{"bird", "parrot"}, thing(60, 100, 180, form{w: 1, count: 1, radius: 0.13, aspect: 0.8, low: 0.4})},
		{[]string{"fish", "goldfish"}, thing(245, 130, 30, form{w: 1, count: 3, radius: 0.1, aspect: 0.5, low: 0.5})},
		{[]string{"fruit", "fruits"}, meaning{obj: tint{1, [3]uint8{225, 95, 30}}, shape: fruits, variety: 0.45}},
		{[]string{"apple", "apples", "cherries", "tomatoes"}, thing(200, 25, 30, fruits)},
		{[]string{"oranges", "tangerines"}, thing(245, 130, 20, fruits)},
		{[]string{"banana", "bananas", "lemon", "lemons"}, thing(240, 215, 50, fruits)},
		{[]string{"grapes", "plums"}, thing(100, 40, 125, fruits)},
		{[]string{"flower", "flowers", "rose", "roses", "tulips"}, thing(235, 60, 120, form{w: 1, count: 5, radius: 0.08, aspect: 1, low: 0.66})},
		{[]string{"tree", "trees"}, thing(30, 115, 40, form{w: 1, count: 3, radius: 0.15, aspect: 1.6, low: 0.55})},
		{[]string{"sun"}, thing(255, 215, 80, form{w: 1, count: 1, radius: 0.14, aspect: 1, low: 0.35})},
		{[]string{"moon"}, thing(235, 235, 215, form{w: 1, count: 1, radius: 0.1, aspect: 1, low: 0.28})},
		{[]string{"lighthouse", "tower"}, thing(225, 55, 45, form{w: 1, count: 1, radius: 0.1, aspect: 3, square: 0.8, low: 0.52})},
		{[]string{"jellyfish"}, thing(235, 120, 225, form{w: 1, count: 3, radius: 0.12, aspect: 1, low: 0.45})},
		{[]string{"car", "bus", "truck"}, thing(195, 30, 30, form{w: 1, count: 1, radius: 0.22, aspect: 0.45, square: 0.6, low: 0.7})},
		{[]string{"house", "cabin", "castle"}, thing(180, 120, 80, form{w: 1, count: 1, radius: 0.22, aspect: 0.9, square: 0.9, low: 0.6})},
		{[]string{"bridge"}, thing(200, 60, 30, form{w: 1, count: 1, radius: 0.42, aspect: 0.15, square: 0.8, low: 0.55})},
		{[]string{"boat", "ship", "sailboat"}, thing(240, 240, 240, form{w: 1, count: 1, radius: 0.14, aspect: 0.5, square: 0.5, low: 0.6})},
		{[]string{"mountain", "mountains"}, thing(110, 110, 125, form{w: 1, count: 2, radius: 0.3, aspect: 0.7, low: 0.72})},
		{[]string{"comet", "stars", "star"}, thing(250, 250, 220, form{w: 1, count: 5, radius: 0.05, aspect: 1, low: 0.4})},
		{[]string{"kite", "balloon"}, thing(230, 40, 60, form{w: 1, count: 1, radius: 0.11, aspect: 1, square: 0.7, low: 0.3})},
		{[]string{"bowl", "vase", "basket"}, meaning{obj: tint{0.2, [3]uint8{235, 235, 230}}, shape: form{w: 0.1, count: 1, radius: 0.3, aspect: 0.6, low: 0.7}}},
		// Places, times, weather.
		{[]string{"snow", "snowy", "winter", "ice", "icy", "frozen"}, snow},
		{[]string{"forest", "woods", "jungle"}, forest},
		{[]string{"grass", "meadow", "field", "garden", "park"}, grass},
		{[]string{"ocean", "sea", "waves", "wave"}, water},
		{[]string{"water", "lake", "river", "underwater"}, meaning{sky: water.sky, ground: water.ground, bands: 0.5}},
		{[]string{"beach", "sand", "sandy", "desert", "dunes"}, sand},
		{[]string{"sunset", "sunrise", "dusk", "dawn", "twilight"}, dusk},
		{[]string{"night", "midnight", "dark"}, night},
		{[]string{"neon", "cyberpunk"}, neon},
		{[]string{"city", "street", "buildings", "skyscrapers", "downtown"}, city},
		{[]string{"storm", "stormy", "thunder", "rain", "rainy"}, storm},
		{[]string{"fog", "foggy", "mist", "misty", "clouds", "cloudy"}, fog},
		{[]string{"sky"}, sky},
		{[]string{"table", "wooden", "wood", "kitchen"}, wood},
		{[]string{"space", "galaxy", "nebula"}, space},
		{[]string{"fire", "flames", "lava", "volcano"}, fire},
		{[]string{"rocky", "rocks", "rock", "cliff", "coast"}, rock},
		{[]string{"deep"}, deep},
		// Words of negative prompts: a washed-out picture to steer away from.
		{[]string{"blurry", "blur", "low", "contrast", "quality", "ugly", "noisy", "grainy", "washed", "dull", "bad", "worst", "pastel", "calm"}, dull},
	}
}

// code writes m's code, scaled by semScale, into dst (semWidth long).
func (m meaning) code(dst []float64) {
	clear(dst)
	dst[semPresence] = 1
	if m.stop {
		dst[semPresence] = 0.3
	}
	put := func(w, k int, t tint) {
		c := rgbColour(t.rgb)
		dst[w] = t.w
		for i := range c {
			dst[k+i] = float64(t.w * c[i])
		}
	}
	put(semObjW, semObjL, m.obj)
	put(semSkyW, semSkyL, m.sky)
	put(semGroundW, semGroundL, m.ground)
	f := m.shape
	dst[semShapeW] = f.w
	dst[semShapeCount] = float64(f.w * f.count)
	dst[semShapeRadius] = float64(f.w * f.radius)
	dst[semShapeAspect] = float64(f.w * f.aspect)
	dst[semShapeSquare] = float64(f.w * f.square)
	dst[semShapeLow] = float64(f.w * f.low)
	dst[semBands] = m.bands
	dst[semVariety] = float64(m.obj.w * m.variety)
	dst[semFlat] = m.flat
	for i := range dst {
		dst[i] = float64(dst[i] * semScale)
	}
}

// newLexicon gives the lexicon's words their token ids, firstTok upwards in
// the order listed, and returns them with each id's code.
func newLexicon() (map[string]uint32, [][]float64) {
	known := make(map[string]uint32)
	var codes [][]float64
	for _, e := range lexicon() {
		c := make([]float64, semWidth)
		e.m.code(c)
		for _, w := range e.words {
			if _, ok := known[w]; ok {
				continue
			}
			known[w] = uint32(firstTok + len(codes))
			codes = append(codes, c)
		}
	}
	return known, codes
}

// maxChannel bounds a colour's decoded channel before the soft clip.
const maxChannel = 2.2

// rgbColour is the latent colour that decodes to about the sRGB bytes rgb:
// it undoes, channel by channel, the decoder's sigmoid and the sampler's
// soft clip (bounded), then inverts the decoder's linear map from latent to RGB.
func rgbColour(rgb [3]uint8) colour {
	var v [3]float64
	for i, b := range rgb {
		p := clamp((float64(b)+0.5-128)/127.5, -0.985, 0.985)
		x := unsquash(p) / 1.1
		q := clamp(x/latentLimit, -0.95, 0.95)
		// Near black and white the inverse runs away; a bound keeps them
		// neutral (all three channels at it) and within the soft clip.
		v[i] = clamp(float64(latentLimit*unsquash(q)), -maxChannel, maxChannel)
	}
	// decode: r = L + 1.2a + 0.3b, g = L - 0.6a + 0.45b, bl = L - 0.15a - 1.2b.
	// Subtracting rows leaves two equations in a and b.
	r, g, bl := v[0], v[1], v[2]
	// (r-g) = 1.8a - 0.15b; (g-bl) = -0.45a + 1.65b.
	d1, d2 := r-g, g-bl
	det := float64(1.8*1.65) - float64(0.15*0.45)
	a := (float64(d1*1.65) + float64(d2*0.15)) / det
	bb := (float64(d2*1.8) + float64(d1*0.45)) / det
	l := r - float64(1.2*a) - float64(0.3*bb)
	return colour{l, a, bb}
}

// unsquash inverts squash on (-1, 1).
func unsquash(p float64) float64 { return p / math.Sqrt(1-float64(p*p)) }

// sense is the code read back off a pooled embedding: strengths in [0, 1]
// and the weighted means they apply.
type sense struct {
	obj, sky, ground    colour
	objS, skyS, groundS float64
	shape               form // w holds the shape's strength
	bands, variety      float64
	flat                float64
}

// strength turns a weight's share of the prompt's presence into how fully
// it applies: one word of eight or so is enough (presence counts the words
// more than once: each row also holds a share of the rows before it).
func strength(w, presence float64) float64 { return clamp(float64(10*w)/presence, 0, 1) }

// readSense reads code c, the last semWidth dimensions of a pooled
// embedding. A prompt of unknown words gives all strengths zero.
func readSense(c []float64) sense {
	var s sense
	if len(c) != semWidth {
		return s
	}
	v := func(k int) float64 { return c[k] - c[semRef] }
	presence := v(semPresence)
	if !(presence > 1e-6) {
		return s
	}
	mean := func(w, k int) (colour, float64) {
		wt := v(w)
		if !(wt > 1e-6) {
			return colour{}, 0
		}
		return colour{v(k) / wt, v(k+1) / wt, v(k+2) / wt}, strength(wt, presence)
	}
	s.obj, s.objS = mean(semObjW, semObjL)
	s.sky, s.skyS = mean(semSkyW, semSkyL)
	s.ground, s.groundS = mean(semGroundW, semGroundL)
	if wt := v(semShapeW); wt > 1e-6 {
		s.shape = form{
			w:      strength(wt, presence),
			count:  v(semShapeCount) / wt,
			radius: v(semShapeRadius) / wt,
			aspect: v(semShapeAspect) / wt,
			square: clamp(v(semShapeSquare)/wt, 0, 1),
			low:    clamp(v(semShapeLow)/wt, 0.1, 0.9),
		}
	}
	s.bands = strength(v(semBands), presence)
	if wt := v(semObjW); wt > 1e-6 {
		s.variety = clamp(v(semVariety)/wt, 0, 1)
	}
	s.flat = strength(v(semFlat), presence)
	return s
}
